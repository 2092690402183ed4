"""Hangs explained: every rank's collectives are recorded (``harness.rank.ledger``) and, when a
run fails or stops making progress, the first collective the ranks disagree on is named
(``harness.controller.ledgers``), or, where they agree, the one every rank waits in. Planted in
a user's script (``examples/minimal_script.py``) and run on real ranks."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from harness.controller.ledgers import compare, read_ledger
from harness.controller.scenario_runs import run_plan
from harness.controller.watch import STACK_DUMP_WAIT_S
from harness.rank.ledger import Ledger
from harness.scenario import load_scenario
from harness.scenario.plan import plan_scenario
from harness.schema import read_events
from tests.conftest import REPO, script_scenario

SCRIPT = (REPO / "examples" / "minimal_script.py").read_text()
NO_PROGRESS_S = 5


def _e(seq: int, op: str = "all_sum", shape: tuple[int, ...] = (4,), site: str = "t.py:1 in main",
       step: int = 1) -> dict:
    return {"seq": seq, "op": op, "shape": list(shape), "dtype": "float32", "stream": None, "group": 2,
            "peer": None, "step": step, "site": site}


def test_the_first_divergence_is_named_with_each_side() -> None:
    extra = compare({0: [_e(0), _e(1, shape=(1,), site="t.py:9 in main", step=3)], 1: [_e(0), _e(1, shape=())]})
    assert not extra["agree"] and extra["seq"] == 1
    assert "rank 0: all_sum float32[1] at t.py:9 in main (step 3)" in extra["line"]
    assert "rank 1: all_sum float32[]" in extra["line"]
    missing = compare({0: [_e(0), _e(1)], 1: [_e(0)]})
    assert "diverge at call #1" in missing["line"] and "rank 1: no collective" in missing["line"]
    agree = compare({0: [_e(0), _e(1, site="t.py:7 in main")], 1: [_e(0), _e(1, site="t.py:7 in main")]})
    assert agree["agree"] and agree["seq"] == 1 and "#1 all_sum float32[4] at t.py:7 in main" in agree["line"]
    p2p = compare({0: [_e(0, "send")], 1: [_e(0, "recv")]})
    assert p2p["agree"]  # one rank sends what the other receives
    assert compare({0: [_e(0)]}) is None


def test_a_torn_last_line_is_left_out(tmp_path: Path) -> None:
    path = tmp_path / "rank0.collectives.jsonl"
    path.write_text(json.dumps(_e(0)) + "\n" + '{"seq": 1, "op": "all_')
    assert read_ledger(path) == [_e(0)] and read_ledger(tmp_path / "none.jsonl") is None


def test_a_compiled_function_records_its_trace_on_every_call(tmp_path: Path) -> None:
    import mlx.core as mx

    def step(x: mx.array) -> mx.array:
        return mx.distributed.all_sum(x * 2) + mx.distributed.all_max(x)

    def ops(path: Path) -> list[tuple]:
        return [(e["op"], tuple(e["shape"]), e["step"], e["site"]) for e in read_ledger(path)]

    for name in ("eager", "compiled"):
        ledger = Ledger(tmp_path / name, 1)
        ledger.install()
        try:
            f = mx.compile(step) if name == "compiled" else step
            for n, width in enumerate((4, 4, 4, 5), 1):  # the last call traces again: a new shape
                ledger.step = n
                mx.eval(f(mx.ones((width,))))
        finally:
            ledger.uninstall()
    assert ops(tmp_path / "compiled") == ops(tmp_path / "eager") and len(ops(tmp_path / "eager")) == 8
    assert [e.get("compiled") for e in read_ledger(tmp_path / "compiled")][::2] == [f"step#{n}" for n in range(1, 5)]
    assert mx.compile.__module__ != __name__  # put back


def test_a_call_site_is_the_first_frame_outside_mlx_and_the_harness_else_the_harness_frame_nearest_the_call(
) -> None:
    import _thread
    import threading

    from harness.rank import ledger

    here = Path(ledger.__file__).parent / "trainer_like.py"  # a frame the walk takes for the harness's own
    code = compile("def call():\n    return site()\n\n\ndef deeper():\n    return call()\n\n\n"
                   "def run(got, done):\n    got.append(deeper())\n    done.set()\n", str(here), "exec")
    harness_frames: dict = {"site": lambda: ledger.call_site(ledger._mlx_dir())}
    exec(code, harness_frames)  # noqa: S102 - functions whose frames name a file in the harness

    def mine() -> tuple[str, bool]:
        return harness_frames["deeper"]()

    line = mine.__code__.co_firstlineno + 1
    assert mine() == (f"test_ledger.py:{line} in mine", True)  # past two harness frames, to the caller's
    got: list = []
    done = threading.Event()
    _thread.start_new_thread(harness_frames["run"], (got, done))  # a stack of harness frames alone
    assert done.wait(10) and got == [("trainer_like.py:2 in call", False)]  # the nearest the call


def _planted(tmp_path: Path, name: str, old: str, new: str, script: str = SCRIPT):  # noqa: ANN202
    assert old in script
    path = script_scenario(tmp_path, script.replace(old, new, 1), name, world_sizes=(2,),
                           no_progress_s=NO_PROGRESS_S)
    (out,) = run_plan(plan_scenario(load_scenario(path)), artifacts=tmp_path / "kept")
    named = time.time()
    heard = [e["time"] for r in range(2) for e in read_events(tmp_path / "kept" / "ddp2" / f"rank{r}.events.jsonl")
             if e["kind"] in ("step", "phase", "start")]
    return out, named - max(heard)


STEP = "        optimizer.update(model, grads)\n"
GRADS = "        grads = global_gradient(grads, tokens, group)\n"
EVAL = "        mx.eval(model.parameters(), optimizer.state, loss, tokens)\n"


@pytest.mark.ranks
@pytest.mark.parametrize("defect, old, new, named", [
    ("extra_all_sum", STEP,
     STEP + "        if rank == 0 and step == 3:\n"
            "            mx.eval(mx.distributed.all_sum(mx.ones(64), group=group))\n",
     ["rank 0: all_sum float32[64] at extra_all_sum.py:", "(step 3)", "rank 1: no collective"]),
    ("ragged_batch", "        mine = picked[rank::size]  # this rank's share of the global batch\n",
     "        mine = picked[rank::size]\n        mine = mine[:-1] if rank == 1 and step == 3 else mine\n"
     "        mx.eval(mx.distributed.all_gather(mx.array([len(r[0]) for r in mine]), group=group))\n",
     ["all_gather int32[4] at ragged_batch.py:", "all_gather int32[3] at ragged_batch.py:"]),
    ("skipped_allreduce", GRADS,
     "        if rank == 1 and step == 3:\n            grads = tree_map(lambda g: g / tokens, grads)\n"
     "        else:\n            grads = global_gradient(grads, tokens, group)\n",
     ["rank 0: all_sum float32[", "in <lambda> (step 3)", "rank 1: all_sum float32[] at skipped_allreduce.py:"]),
    ("compiled_skip", GRADS,
     "        if rank == 0 and step == 3:\n            grads = tree_map(lambda g: g / tokens, grads)\n"
     "        else:\n            grads = reduce(grads, tokens)\n",
     ["rank 0: all_sum float32[] at compiled_skip.py:", "rank 1: all_sum float32[",
      "in <lambda> (compiled <lambda>#3, step 3)"]),
    ("stopped_rank", EVAL,
     "        if rank == 1 and step == 3:\n            import os, signal\n"
     "            os.kill(os.getpid(), signal.SIGSTOP)\n" + EVAL,
     ["collectives agree on every rank", "is where the ranks wait", "at stopped_rank.py:"]),
])
def test_a_planted_desync_is_named_in_the_failure_and_the_result(tmp_path: Path, defect: str, old: str, new: str,
                                                                 named: list[str]) -> None:
    loop = "    for step in range(1, run.steps + 1):\n"  # compiled once, before the loop: later calls do not trace
    script = SCRIPT.replace(loop, "    reduce = mx.compile(lambda g, t: global_gradient(g, t, group))\n" + loop)
    out, took = _planted(tmp_path, defect, old, new, script if defect == "compiled_skip" else SCRIPT)
    assert not out.ok and out.collectives is not None, out.failure
    line = out.collectives["line"]
    assert line in out.failure
    for text in named:
        assert text in line, line
    assert out.collectives["agree"] == (defect == "stopped_rank")
    print(f"{defect}: named {took:.2f} s after the last progress event (no-progress limit {NO_PROGRESS_S} s): {line}")
    # at the no-progress limit, not the wall's (240 s): the limit, the stacks' dump (at most STACK_DUMP_WAIT_S)
    # and 3 s for a loaded machine (beside the rest of the suite on 2 cores it once took 7.07 s; alone 5.3 to 6.8)
    assert took <= NO_PROGRESS_S + STACK_DUMP_WAIT_S + 3, took
