"""Failure handling inside the trainer, with real ranks: every fault mode in a trainer phase, a data
error that only one rank sees, rank-0-only side effects, diagnostics, and a pre-sharded source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.controller.run_job import execute
from harness.scenario import load_scenario
from harness.scenario.plan import job_for
from tests.conftest import cli, write_scenario
from tests.test_launch import assert_clean

pytestmark = pytest.mark.ranks

def train(path: Path, run: str, keep: Path | None = None, no_progress_s: float = 60):  # noqa: ANN201
    s = load_scenario(path)
    spec = s.run(run)
    return execute(spec.name, job_for(s, spec.name), spec.world_size, wall_s=120, no_progress_s=no_progress_s,
                   keep_to=keep)


def with_eval(path: Path) -> Path:
    path.write_text(path.read_text().replace("rows = 21", "rows = 21\neval_rows = 5").replace(
        "digest_every = 2", "digest_every = 2\neval_every = 2"))
    return path


@pytest.mark.parametrize(
    ("action", "phase", "expect"),
    [
        ("raise", "fetch", "rank 1 failed while fetching a batch at step 2: RuntimeError: injected fault"),
        ("exit", "step", "rank 1 ended with exit code 3"),
        ("sigkill", "update", "rank 1 ended with signal SIGKILL"),
        ("segfault", "eval", "rank 1 ended with signal SIGSEGV"),
        ("exit0", "fetch", "rank 1 exited with exit code 0 without writing a result, after step 1"),
    ],
)
def test_fault_modes_in_trainer_phases(scenario_dir: Path, action: str, phase: str, expect: str) -> None:
    fault = f'\n[[faults]]\nrank = 1\nstep = 2\nphase = "{phase}"\naction = "{action}"\n'
    path = with_eval(write_scenario(scenario_dir, f"f_{action}", world_sizes=(2,), extra=fault))
    out = train(path, "ddp2")
    assert not out.ok
    assert out.failure.splitlines()[0].startswith(expect), out.failure
    # Failures that reach the consensus end every rank at once; a rank that vanishes with exit 0
    # would leave its peer waiting in a collective: the watchdog stops the run at once.
    assert out.watch.limit is None or (action == "exit0" and out.watch.limit == "rank_gone"), \
        (out.watch.limit, out.watch.limit_detail, out.failure)
    assert_clean(out)


def test_hang_in_a_collective_phase_is_caught_by_no_progress(scenario_dir: Path, tmp_path: Path) -> None:
    fault = '\n[[faults]]\nrank = 0\nstep = 4\nphase = "save"\naction = "hang"\n'
    path = write_scenario(scenario_dir, "hang", world_sizes=(2,), extra=fault)
    out = train(path, "ddp2", keep=tmp_path, no_progress_s=5)
    assert not out.ok and out.watch.limit == "no_progress" and out.watch.stacks_dumped
    assert "watchdog: no progress from any rank for 5 s" in out.failure
    assert "inject" in (tmp_path / "rank0.stderr").read_text()  # rank 0's stack shows where it hung
    assert_clean(out)


def test_a_bad_row_seen_by_one_rank_stops_every_rank(scenario_dir: Path) -> None:
    rows = [{"prompt": f"q{i} ", "completion": f"a{i}"} for i in range(12)]
    lines = [json.dumps(r) for r in rows]
    lines[5] = json.dumps({"prompt": "no completion"})  # row 5 belongs to rank 1 of 2 (ordered plan)
    (scenario_dir / "rows.jsonl").write_text("\n".join(lines) + "\n")
    # the failing rank writes its record last (as on a loaded machine): every rank waits for every record
    delay = '\n[[faults]]\nrank = 1\nstep = 1\nphase = "record"\naction = "delay"\n'
    path = write_scenario(scenario_dir, "badrow", world_sizes=(2,), extra=delay)
    path.write_text(path.read_text().replace("rows = 21", 'source = "jsonl"\npath = "rows.jsonl"\nrows = 12'))
    out = train(path, "ddp2")
    assert not out.ok
    first, second = out.failure.splitlines()[:2]
    assert first.startswith("rank 1 failed while loading the data: ValueError: ") and "rows.jsonl:6" in first
    assert second.startswith("rank 0: a peer rank failed: rank 1 failed while loading the data")
    assert_clean(out)


def test_a_stop_every_rank_agrees_on_is_named_by_every_rank(scenario_dir: Path) -> None:
    """Prompts longer than ``max_seq_len`` leave no supervised token: every rank stops with the same
    line, even where one writes its record late (each waits for every record before it exits)."""
    delay = '\n[[faults]]\nrank = 1\nstep = 1\nphase = "record"\naction = "delay"\n'
    path = write_scenario(scenario_dir, "zero", world_sizes=(2,), extra=delay)
    path.write_text(path.read_text().replace("rows = 21", 'rows = 21\nformat = "prompt_completion"\nmax_seq_len = 16'))
    out = train(path, "ddp2")
    assert not out.ok
    assert out.failure.splitlines() == [f"rank {r} failed: step 1: the global batch has zero supervised tokens "
                                        "across all 2 ranks" for r in (0, 1)], out.failure
    assert_clean(out)
    # the same at an eval: rows that train, eval rows whose prompts leave no answer token
    rows = [json.dumps({"prompt": f"q{i} ", "completion": f"a{i}"}) for i in range(12)]
    (scenario_dir / "rows.jsonl").write_text("\n".join(rows) + "\n")
    (scenario_dir / "eval.jsonl").write_text(json.dumps({"prompt": "x" * 40, "completion": "yy"}) + "\n")
    path = with_eval(write_scenario(scenario_dir, "zero_eval", world_sizes=(2,), extra=delay))
    path.write_text(path.read_text().replace("rows = 21", 'source = "jsonl"\npath = "rows.jsonl"\nrows = 12\n'
                                             'max_seq_len = 16\neval_path = "eval.jsonl"'))
    out = train(path, "ddp2")
    assert not out.ok
    assert out.failure.splitlines() == [f"rank {r} failed: eval after step 2: zero supervised tokens across all 2 "
                                        "ranks" for r in (0, 1)], out.failure
    assert_clean(out)


def test_side_effects_happen_on_rank_0_only_and_diagnostics_are_complete(scenario_dir: Path,
                                                                         tmp_path: Path) -> None:
    path = with_eval(write_scenario(scenario_dir, "effects", world_sizes=(2,)))
    out = train(path, "ddp2", keep=tmp_path)
    assert out.ok, out.failure
    assert sorted(p.name for p in tmp_path.glob("*.callbacks.jsonl")) == ["rank0.callbacks.jsonl"]
    calls = [json.loads(x) for x in (tmp_path / "rank0.callbacks.jsonl").read_text().splitlines()]
    assert [c["kind"] for c in calls] == ["step", "step", "eval", "step", "step", "eval"]
    assert (tmp_path / "train.log").read_text().count("\n") == 6
    r0, r1 = (o.result for o in out.ranks)
    assert r0["side_effects"] == {"callbacks": 6, "log_lines": 6, "saves": 1, "checkpoints": 0, "probes": 0}
    assert r1["side_effects"] == {"callbacks": 0, "log_lines": 0, "saves": 0, "checkpoints": 0, "probes": 0}
    for r, res in enumerate((r0, r1)):
        assert res["rank"] == r and res["world_size"] == 2 and res["is_main"] == (r == 0)
        assert res["host_rank_map"] == {res["host"]: [0, 1]}
        assert [p["rank"] for p in res["per_rank"]] == [0, 1]
        assert all(p["tokens"] > 0 and p["mlx_peak_bytes"] > 0 and p["runtime_s"] > 0 for p in res["per_rank"])
        assert len(res["tok_s_local"]) == len(res["step_times_s"]) == 4
        assert res["compile"] == {"mode": "off", "scope": "none", "fallback_reason": None}
        assert [e["step"] for e in res["evals"]] == [2, 4]
        assert res["global_rng_untouched"] is True
    assert r0["per_rank"] == r1["per_rank"]  # the same gathered table on every rank
    assert r0["per_rank"][1]["tokens"] == r1["tokens_local"] != r1["tokens_global"]


def test_a_source_sharded_by_the_caller_is_refused(scenario_dir: Path) -> None:
    (scenario_dir / "rows.0.jsonl").write_text('{"text": "x"}\n')
    path = write_scenario(scenario_dir, "presharded", world_sizes=(2,))
    path.write_text(path.read_text().replace("rows = 21", 'source = "jsonl"\npath = "rows.{rank}.jsonl"'))
    p = cli("run", str(path))
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "[data].path" in p.stderr and "sharded per rank" in p.stderr
