"""``collective_agreement`` on real ranks: every run of more than one rank has its ranks' ledgers
compared, so a divergence that does not hang is named (call, op, dtype, shape, site, step, ranks),
in the text and in ``result.json``, and the parity checks it wrecked point to it; a rank that
issues a collective after its peer finished is reported as that, not as the backend's socket error
alone. Planted in a user's script (``examples/minimal_script.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, script_scenario

SCRIPT = (REPO / "examples" / "minimal_script.py").read_text()
TOKENS = "        tokens = mx.distributed.all_sum(mask.sum(), group=group)  # the global batch's supervised tokens\n"
FINISH = "    run.finish(model.parameters())  # 5. the final parameters, judged for parity\n"


def _run(tmp_path: Path, name: str, old: str, new: str, world_sizes: tuple[int, ...], script: str = SCRIPT
         ) -> tuple[dict, str, int]:
    assert old in script
    path = script_scenario(tmp_path, script.replace(old, new, 1), name, world_sizes=world_sizes, no_progress_s=20)
    p = subprocess.run([sys.executable, "-m", "harness", "run", str(path), "--out", str(tmp_path / "out"),
                        "--progress", "off", "--no-plots"], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in p.stderr, p.stderr
    return json.loads((tmp_path / "out" / "result.json").read_text()), p.stdout, p.returncode


def _line(tmp_path: Path, name: str) -> int:
    """The 1-based line of the planted call in the script as written."""
    return next(n for n, text in enumerate((tmp_path / f"{name}.py").read_text().splitlines(), 1) if "PLANTED" in text)


@pytest.mark.ranks
def test_a_dtype_divergence_that_does_not_hang_is_named(tmp_path: Path) -> None:
    planted = TOKENS.replace("mask.sum()", "mask.sum().astype(mx.int32 if rank == 1 and step == 3 else mx.float32)")
    result, stdout, code = _run(tmp_path, "int_sum", TOKENS, planted.rstrip("\n") + "  # PLANTED\n", (1, 2))
    (s,) = result["scenarios"]
    checks = {(c["name"], c["run"]): c for c in s["checks"]}
    agree = checks[("collective_agreement", "ddp2")]
    site = f"int_sum.py:{_line(tmp_path, 'int_sum')} in global_loss_and_grad"
    assert agree["result"] == "FAIL" and code == 1, agree
    for text in ("collectives diverge at call #", f"rank 0: all_sum float32[] at {site} (step 3)",
                 f"rank 1: all_sum int32[] at {site} (step 3)"):
        assert text in agree["detail"], agree["detail"]
    run = next(r for r in s["runs"] if r["name"] == "ddp2")
    assert run["ok"] and run["collectives"]["agree"] is False  # it completed: only the ledgers name it
    assert agree["detail"] in stdout
    wrecked = [c for c in s["checks"] if c["run"] == "ddp2" and c["result"] == "FAIL" and c is not agree]
    assert wrecked, "the divergence wrecked nothing else"
    assert all(c["detail"].startswith("the ranks' collectives diverged first, at call #") for c in wrecked), wrecked
    single = checks.get(("collective_agreement", "single"))
    assert single is None  # one rank has nothing to compare


@pytest.mark.ranks
def test_a_collective_after_the_peer_finished_names_both_sides(tmp_path: Path) -> None:
    extra = FINISH + ("    if rank == 0:  # one rank alone, after the other reported and exited\n"
                      "        import time\n        time.sleep(1)\n"
                      "        mx.eval(mx.distributed.all_sum(mx.ones(3), group=group))  # PLANTED\n")
    result, stdout, code = _run(tmp_path, "one_sided", FINISH, extra, (2,))
    (s,) = result["scenarios"]
    run = next(r for r in s["runs"] if r["name"] == "ddp2")
    site = f"one_sided.py:{_line(tmp_path, 'one_sided')} in main"
    assert not run["ok"] and code == 3 and run["collectives"] is not None, run["failure"]
    line = run["collectives"]["line"]
    assert f"rank 0: all_sum float32[3] at {site}" in line, line
    assert "rank 1: no collective (finished; its last: all_sum" in line, line
    assert line in run["failure"] and line in stdout


FSDP = '''import mlx.core as mx
import mlx.nn as nn

from harness import api


def main():
    run = api.session()
    group = mx.distributed.init()
    mx.random.seed(run.seed)
    model = run.split(nn.fully_shard(nn.Linear(8, 8), group=group))  # MLX's FSDP: gradients by sum_scatter
    grad_fn = nn.value_and_grad(model, lambda m, x: m(x).sum())
    optimizer = run.optimizer()
    for step in range(1, run.steps + 1):
        loss, grads = grad_fn(model, mx.ones((4, 8)))
        optimizer.update(model, grads)
        mx.eval(model.parameters(), loss)
        run.step(step, loss.item(), 32, 16, lr=optimizer.learning_rate.item(), params=model.parameters())
    run.finish(model.parameters())


main()
'''


@pytest.mark.ranks
def test_what_ring_lacks_is_probed_from_mlx() -> None:
    from harness.controller.backend_ops import backend_ops

    ops = backend_ops("ring")
    assert isinstance(ops, dict), ops
    assert ops["sum_scatter"] is not None and "sum_scatter" in ops["sum_scatter"], ops
    assert all(ops[op] is None for op in ("all_sum", "all_gather", "all_max", "all_min", "send", "recv")), ops


@pytest.mark.ranks
def test_fsdp_on_ring_is_refused_before_launch_or_named_where_it_raises(tmp_path: Path) -> None:
    path = script_scenario(tmp_path, FSDP, "fsdp", world_sizes=(2,), no_progress_s=20)
    declared = tmp_path / "declared.toml"
    needs = 'path = "fsdp.py"\ncollectives = ["sum_scatter"]\n'
    declared.write_text(path.read_text().replace('path = "fsdp.py"\n', needs, 1))
    p = subprocess.run([sys.executable, "-m", "harness", "run", str(declared), "--out", str(tmp_path / "refused")],
                       capture_output=True, text=True, timeout=300)
    said = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert any("[trainer] collectives names sum_scatter" in x and "the ring backend lacks sum_scatter" in x
               for x in said), said
    assert not (tmp_path / "refused" / "runs").exists()  # nothing launched
    # undeclared, it runs and raises there: the failure names the call, its site and the backend's lack
    result, stdout, code = _run(tmp_path, "fsdp", "main()\n", "main()  # PLANTED\n", (2,), FSDP)
    run = result["scenarios"][0]["runs"][0]
    assert code == 3 and not run["ok"], run
    assert "the ring backend lacks sum_scatter" in run["failure"] and "sum_scatter float32[" in run["failure"], \
        run["failure"]
    assert "in main" in run["failure"] or "distributed.py" in run["failure"], run["failure"]


@pytest.mark.ranks
def test_without_ledgers_the_check_is_na_never_a_pass(tmp_path: Path) -> None:
    path = script_scenario(tmp_path, SCRIPT, "unrecorded", world_sizes=(2,), no_progress_s=20)
    env = {**os.environ, "MLX_DDP_HARNESS_LEDGER": "0"}
    p = subprocess.run([sys.executable, "-m", "harness", "run", str(path), "--out", str(tmp_path / "out"),
                        "--progress", "off", "--no-plots"], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    (s,) = json.loads((tmp_path / "out" / "result.json").read_text())["scenarios"]
    (c,) = [c for c in s["checks"] if c["name"] == "collective_agreement"]
    assert c["result"] == "n/a" and "no rank kept a collective ledger" in c["detail"], c
