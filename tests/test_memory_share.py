"""One machine's memory shared among its ranks (issue 44, item 3): each rank's share, MLX's limit
functions capped at it and recorded (mlx-lm's real ``set_wired_limit`` call at 2 ranks, mlx-vlm's
real none), the ``wired_share`` check failing on a rank that holds more (the ``allocate`` fault
under a small budget) and passing otherwise, and the memory budget that admits launches
(refused before launch when it can never fit; a launch that does not fit beside others waits)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.controller import rank_budget
from harness.controller.outcome import RankOutcome, RunOutcome, WatchReport
from harness.controller.run_job import execute
from harness.judge.memory_checks import wired_share
from harness.memory import plan as memory_plan
from harness.memory.plan import MB, parse_size, share_of
from harness.scenario import load_scenario
from harness.scenario.plan import job_for, plan_scenario
from tests.conftest import REPO, cli, train_result, write_scenario

GB = 2**30


def test_sizes_parse_in_powers_of_1024_and_bad_ones_are_refused() -> None:
    assert parse_size("6GB") == 6 * GB and parse_size("512MB") == 512 * MB and parse_size("1.5 GiB") == 3 * GB // 2
    assert parse_size("1048576") == MB and parse_size("64k") == 64 * 1024
    for bad in ("", "six GB", "-1GB", "0MB", "5 parsecs", "1e9"):
        with pytest.raises(ValueError, match="memory size"):
            parse_size(bad)


def test_a_share_is_the_budget_over_the_ranks_on_the_host() -> None:
    assert share_of(8 * GB, 2) == 4 * GB and share_of(8 * GB, 4) == 2 * GB and share_of(10, 3) == 3
    assert share_of(8 * GB, 0) == 8 * GB  # never divided by zero


def test_the_estimates_default_shapes_are_the_tiny_models() -> None:
    from harness.rank.models import TINY
    from harness.rank.vision import TEXT

    for shape in (*TINY.values(), TEXT):
        assert {k: shape[k] for k in memory_plan.TEXT_SHAPE} == memory_plan.TEXT_SHAPE


def _footprint(s, run: str):  # noqa: ANN001, ANN202
    return plan_scenario(s).run(run).footprint


def test_a_ranks_expected_peak_is_its_ceiling_else_an_estimate_from_the_model(tmp_path: Path) -> None:
    s = load_scenario(write_scenario(tmp_path, "est", world_sizes=(2,)))
    n, why = memory_plan.expected_rank_bytes(_footprint(s, "ddp2"))
    params, _ = memory_plan.param_estimate(_footprint(s, "ddp2"))
    assert 50_000 < params < 500_000  # the tiny qwen3: 2 layers of 64, a byte vocabulary
    assert n == int(params * 4 * 4 * 1.5) + 64 * MB and why.startswith("estimated: about 0.")
    big = load_scenario(write_scenario(tmp_path, "big", world_sizes=(2,),
                                       extra='[model.config]\nhidden_size = 1024\nnum_hidden_layers = 8\n'
                                             'intermediate_size = 4096\n'))
    assert memory_plan.expected_rank_bytes(_footprint(big, "ddp2"))[0] > 1500 * MB  # about 135M params in float32
    ceiling = load_scenario(write_scenario(tmp_path, "ceil", world_sizes=(2,), checks="max_mlx_mb = 100\n"
                                                                                        "max_rss_mb = 300"))
    assert memory_plan.expected_rank_bytes(_footprint(ceiling, "ddp2")) == (
        300 * MB, "the ceiling [checks] max_rss_mb = 300")


def test_a_launch_that_can_never_fit_the_budget_is_a_problem(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    s = load_scenario(write_scenario(tmp_path, "fit", world_sizes=(2,), checks="max_mlx_mb = 100"))
    monkeypatch.setenv(memory_plan.BUDGET_VAR, "200MB")
    assert memory_plan.launch_problem("ddp2", 2, _footprint(s, "ddp2")) is None
    monkeypatch.setenv(memory_plan.BUDGET_VAR, "150MB")
    assert memory_plan.launch_problem("ddp2", 2, _footprint(s, "ddp2")) == (
        "run ddp2: its 2 rank(s) are expected to peak at 200 MB (the ceiling [checks] max_mlx_mb = 100 per rank), "
        "more than the memory budget of 150 MB (MLX_DDP_HARNESS_MEMORY_BUDGET / --memory-budget)")
    monkeypatch.setenv(memory_plan.BUDGET_VAR, "300MB")  # the scenario's own budget is lower
    path = write_scenario(tmp_path, "low", world_sizes=(2,), checks="max_mlx_mb = 100")
    path.write_text(path.read_text().replace("no_progress_s = 90\n", "no_progress_s = 90\nmemory_budget_mb = 150\n"))
    low = load_scenario(path)
    assert low.limits.memory_budget_mb == 150
    problem = memory_plan.launch_problem("ddp2", 2, _footprint(low, "ddp2"))
    assert "memory budget of 150 MB ([limits] memory_budget_mb)" in problem


def test_mlx_limits_are_capped_at_the_share_and_recorded_with_their_caller() -> None:
    import mlx.core as mx

    from harness.memory import share as memory_share
    from harness.scenario.job import AllSumJob

    cache_before = mx.set_cache_limit(mx.set_cache_limit(0))  # read it, put it back
    try:
        job = AllSumJob(world_size=4, memory={"budget_bytes": 8 * GB, "budget_source": "a test",
                                              "ranks_on_host": [2, 2, 2, 2]})
        state = memory_share.install(job, 3)
        assert (state.share_bytes, state.ranks_on_host, state.budget_bytes) == (4 * GB, 2, 8 * GB)
        info = mx.device_info()
        assert info[memory_plan.WORKING_SET_KEY] == state.working_set_bytes > 0
        from mlx_lm.utils import maybe_set_recommended_wired_limit

        maybe_set_recommended_wired_limit()
        mx.set_cache_limit(64 * MB)
        calls = [(c.limit, c.asked, c.set, c.caller) for c in state.calls]
        assert calls == [("wired", state.working_set_bytes, min(state.working_set_bytes, 4 * GB), "mlx_lm.utils"),
                         ("cache", 64 * MB, 64 * MB, __name__)]
        assert mx.set_cache_limit(cache_before) == 64 * MB  # the real function got the capped value
        mx.set_cache_limit(limit=32 * MB)  # MLX's keyword
        assert (state.calls[-1].asked, state.calls[-1].set) == (32 * MB, 32 * MB)
        assert mx.set_cache_limit(cache_before) == 32 * MB
    finally:
        memory_share.uninstall()
        mx.set_cache_limit(cache_before)
        mx.set_wired_limit(0)  # MLX's default (a no-op off Metal)
    assert memory_plan.WORKING_SET_KEY not in mx.device_info() or mx.metal.is_available()
    assert memory_share.current() is None


def _outcome(shares: list[dict | None], peaks: list[int]) -> RunOutcome:
    ranks = [RankOutcome(r, 0, False, train_result(rank=r, mlx_peak_bytes=peaks[r],
                                                   **({"memory_share": sh} if sh is not None else {})), [], "")
             for r, sh in enumerate(shares)]
    return RunOutcome("ddp2", len(shares), "ring", True, None, ranks, WatchReport(1.0, 0))


def _share(share_mb: int, calls: list[dict] | None = None) -> dict:
    return {"working_set_bytes": 16 * GB, "working_set_source": "a test", "budget_bytes": 2 * share_mb * MB,
            "budget_source": "a test's budget", "ranks_on_host": 2, "share_bytes": share_mb * MB, "calls": calls or []}


def test_wired_share_fails_naming_the_rank_the_figure_and_the_share() -> None:
    ok = wired_share(_outcome([_share(256), _share(256)], [10 * MB, 12 * MB]))
    assert ok.passed and ok.result == "pass" and (ok.value, ok.limit) == (12.0, 256.0), ok
    fat = wired_share(_outcome([_share(256), _share(256)], [10 * MB, 400 * MB]))
    assert not fat.passed and (fat.value, fat.limit) == (400.0, 256.0)
    assert fat.detail.startswith("rank 1: MLX peak memory 400.0 MB above its share 256.0 MB"), fat.detail
    call = {"limit": "wired", "function": "mx.set_wired_limit", "asked": GB, "set": 256 * MB, "caller": "x.y"}
    wired = wired_share(_outcome([_share(256, [call]), _share(256)], [MB, MB]))  # asked for more, capped: held less
    assert wired.passed and "(first: mx.set_wired_limit from x.y asked 1024.0 MB, set 256.0 MB)" in wired.detail
    na = wired_share(_outcome([None, None], [MB, MB]))
    assert na.result == "n/a" and "kind = \"command\"" in na.detail
    half = wired_share(_outcome([_share(256), None], [MB, MB]))
    assert not half.passed and half.detail == "rank 1 recorded no memory share"


HOLDER = """
import sys, time
from harness.controller import rank_budget
slots = rank_budget.hold(1, "run 'big'", memory_bytes=int(sys.argv[1]))
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_a_launch_waits_until_its_memory_fits_beside_the_live_claims(tmp_path: Path, monkeypatch, capsys) -> None:  # noqa: ANN001
    env = {rank_budget.DIR_VAR: str(tmp_path / "slots"), rank_budget.BUDGET_VAR: "8",
           memory_plan.BUDGET_VAR: "1GB"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(rank_budget, "NOTICE_AFTER_S", 0.2)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(700 * MB), "1.2"], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        small = rank_budget.hold(1, "run 'small'", memory_bytes=200 * MB)  # fits beside it: no wait
        assert small.waited_s < 0.5 and rank_budget.memory_claims(tmp_path / "slots")[0][0] in (200 * MB, 700 * MB)
        t0 = time.monotonic()
        second = rank_budget.hold(1, "run 'second'", memory_bytes=300 * MB)  # 700 + 200 + 300 > 1024 MB
        assert time.monotonic() - t0 > 0.6 and second.waited_s > 0.6
        assert sorted(n for n, _ in rank_budget.memory_claims(tmp_path / "slots")) == [200 * MB, 300 * MB]
        small.release()
        second.release()
    finally:
        holder.wait(timeout=10)
    err = capsys.readouterr().err
    assert ("run 'second': waiting for 300 MB of this machine's memory budget of 1.0 GB "
            "(MLX_DDP_HARNESS_MEMORY_BUDGET / --memory-budget); claimed: ") in err
    assert "700 MB by run 'big' (pid " in err
    assert list((tmp_path / "slots").glob("mem-*")) == []  # the dead holder's claim went with its lock


def test_a_launch_larger_than_the_budget_waits_only_for_the_others(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv(rank_budget.DIR_VAR, str(tmp_path / "slots"))
    monkeypatch.setenv(memory_plan.BUDGET_VAR, "100MB")
    alone = rank_budget.hold(0, "huge", memory_bytes=GB)  # no rank slots (covered by its holder), still claimed
    assert alone.held == [] and alone.memory is not None and alone.waited_s < 0.5
    alone.release()
    assert list((tmp_path / "slots").glob("mem-*")) == []


@pytest.mark.ranks
def test_a_budget_that_can_never_hold_a_launch_is_refused_before_it_starts(tmp_path: Path) -> None:
    path = write_scenario(tmp_path, "tiny_budget", world_sizes=(2,))
    p = cli("run", str(path), "--memory-budget", "1MB", "--out", str(tmp_path / "o"))
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "more than the memory budget of 1 MB" in lines[0]
    assert "run ddp2: its 2 rank(s) are expected to peak at" in lines[0]
    assert not (tmp_path / "o").exists()
    bad = cli("run", str(path), "--memory-budget", "lots")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: --memory-budget: memory size 'lots': give a positive number with a unit, e.g. 6GB or 512MB")
    env = cli("run", str(path), env={memory_plan.BUDGET_VAR: "-3"})
    assert env.returncode == 2 and env.stderr.strip().splitlines() == [
        "error: MLX_DDP_HARNESS_MEMORY_BUDGET: memory size '-3': give a positive number with a unit, e.g. 6GB or 512MB"]


ALLOCATE = """
[[runs]]
name = "fat2"
world_size = 2

[[faults]]
rank = 1
step = 2
phase = "step"
action = "allocate"
mb = 384
runs = ["fat2"]
"""


@pytest.mark.ranks
def test_wired_share_fails_on_a_rank_holding_more_than_its_share_and_passes_otherwise(tmp_path: Path) -> None:
    """Under a 512 MB budget each of 2 ranks may hold 256 MB: rank 1 of ``fat2`` allocates 384 MB of
    MLX memory at step 2 and fails the check, naming it; the same run without the fault passes."""
    path = write_scenario(tmp_path, "share", world_sizes=(2,), steps=3, extra=ALLOCATE)
    p = cli("run", str(path), "--memory-budget", "512MB", "--out", str(tmp_path / "o"))
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    doc = json.loads((tmp_path / "o" / "result.json").read_text())
    checks = {(c["name"], c["run"]): c for c in doc["scenarios"][0]["checks"]}
    ok, fat = checks[("wired_share", "ddp2")], checks[("wired_share", "fat2")]
    assert ok["result"] == "pass" and ok["limit"] == 256.0 and ok["value"] < 100, ok
    assert fat["result"] == "FAIL" and fat["limit"] == 256.0 and fat["value"] >= 384, fat
    assert fat["detail"].startswith("rank 1: MLX peak memory "), fat["detail"]
    assert "above its share 256.0 MB" in fat["detail"] and "rank 0" not in fat["detail"].split(";")[0]
    failed = {k for k, c in checks.items() if c["result"] == "FAIL"}
    assert failed == {("wired_share", "fat2")}, failed
    rank0 = json.loads((tmp_path / "o" / "runs" / "share" / "ddp2" / "rank0.result.json").read_text())
    share = rank0["memory_share"]
    assert share["budget_bytes"] == 512 * MB and share["ranks_on_host"] == 2 and share["share_bytes"] == 256 * MB
    assert share["calls"] == []  # the reference trainer sets no limit


MLX_LM = """
[scenario]
name = "share_mlx_lm"
seed = 11

[trainer]
kind = "mlx_lm"
fine_tune = "lora"

[model]
arch = "llama"

[data]
rows = 16
min_chars = 48
max_chars = 48
response_only = false

[train]
steps = 2
global_batch = 4

[[runs]]
name = "ddp2"
world_size = 2
"""


@pytest.mark.ranks
def test_mlx_lm_asks_each_rank_for_the_working_set_and_gets_its_share(tmp_path: Path) -> None:
    """mlx-lm's ``train()`` wires the device's recommended working set in every rank: reported
    here (as on a Mac) from the machine's working set, each of the 2 ranks asks for all of it
    and is given half."""
    if importlib.util.find_spec("mlx_lm") is None:
        pytest.skip("mlx-lm is not installed")
    (tmp_path / "s.toml").write_text(MLX_LM)
    s = load_scenario(tmp_path / "s.toml")
    out = execute("ddp2", job_for(s, "ddp2"), 2, wall_s=240, no_progress_s=120)
    assert out.ok, out.failure
    for o in out.ranks:
        share = o.result["memory_share"]
        ws = share["working_set_bytes"]
        assert share["ranks_on_host"] == 2 and share["share_bytes"] == ws // 2 and share["budget_bytes"] is None
        assert share["calls"] == [{"limit": "wired", "function": "mx.set_wired_limit", "asked": ws, "set": ws // 2,
                                   "caller": "mlx_lm.utils"}], share["calls"]
    assert wired_share(out).passed


MLX_VLM = f"""
[scenario]
name = "share_mlx_vlm"
seed = 11

[trainer]
kind = "mlx_vlm"

[model]
arch = "qwen2_vl"

[data]
source = "jsonl"
path = "{REPO / 'scenarios' / 'data' / 'image_counts.jsonl'}"
image_size = 56
max_seq_len = 128

[train]
steps = 2
global_batch = 4

[[runs]]
name = "ddp2"
world_size = 2
"""


@pytest.mark.ranks
def test_mlx_vlm_trainer_sets_no_limit_and_each_rank_records_its_share(tmp_path: Path) -> None:
    """``mlx_vlm.trainer.Trainer`` (what the adapter runs) makes no limit call: only mlx-vlm's
    functional recipes do, behind ``mx.metal.is_available()``. The share is recorded, the calls
    list is empty."""
    if importlib.util.find_spec("mlx_vlm") is None:
        pytest.skip("mlx-vlm is not installed")
    (tmp_path / "s.toml").write_text(textwrap.dedent(MLX_VLM))
    s = load_scenario(tmp_path / "s.toml")
    out = execute("ddp2", job_for(s, "ddp2"), 2, wall_s=300, no_progress_s=150)
    assert out.ok, out.failure
    for o in out.ranks:
        share = o.result["memory_share"]
        assert share["ranks_on_host"] == 2 and share["share_bytes"] == share["working_set_bytes"] // 2
        assert share["calls"] == []
    assert wired_share(out).passed


def test_the_pytest_plugin_takes_the_budget_for_every_launch(tmp_path: Path) -> None:
    """``--mlx-ddp-memory-budget`` sets the budget of the session's launches (and its xdist workers'):
    one that cannot fit is refused before it starts; a size that is none is a usage error."""
    import os

    path = write_scenario(tmp_path, "plugin_budget", world_sizes=(2,))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != memory_plan.BUDGET_VAR}

    def pytest_run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly",
                               str(path), "-q", *args], capture_output=True, text=True, cwd=tmp_path, env=env,
                              timeout=300)

    refused = pytest_run("--mlx-ddp-memory-budget", "1MB", "-k", "launch")
    assert refused.returncode == 1, refused.stdout[-3000:]
    assert "more than the memory budget of 1 MB (MLX_DDP_HARNESS_MEMORY_BUDGET / --memory-budget)" in refused.stdout
    bad = pytest_run("--mlx-ddp-memory-budget", "lots", "--collect-only")
    assert bad.returncode == 4 and "--mlx-ddp-memory-budget: memory size 'lots'" in bad.stderr, bad.stderr


def test_doctor_prints_the_working_set_the_budget_and_the_shares() -> None:
    p = cli("doctor", env={memory_plan.BUDGET_VAR: "6GB"})
    lines = {line.split()[0] + " " + line.split()[1]: line for line in p.stdout.splitlines() if line.startswith(
        ("working set", "memory budget", "memory share"))}
    assert "the machine's physical memory (psutil)" in lines["working set"] or "GPU" in lines["working set"] \
        or "Metal" in lines["working set"], p.stdout
    assert "6.0 GB (MLX_DDP_HARNESS_MEMORY_BUDGET / --memory-budget)" in lines["memory budget"]
    assert "3.0 GB at 2 ranks, 1.5 GB at 4 ranks" in lines["memory share"]
