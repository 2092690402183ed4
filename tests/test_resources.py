"""Resources that run out, with real ranks: a checkpoint write on a full disk, a rank that runs
away in memory (RSS, or MLX memory sampled during a step), an ``--out`` that cannot be written."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness.controller.run_job import execute
from harness.memory.guard import MemoryLimits, RankMemory, over_limit
from harness.memory.sampler import JOB_START, device_baseline_kind
from harness.scenario import CheckSpec, LimitSpec, load_scenario
from harness.scenario.plan import job_for
from harness.trainers.reference import checkpoint
from tests.conftest import cli, write_scenario
from tests.test_launch import assert_clean

CHECKPOINTS = """
[train]
steps = 6
global_batch = 6
checkpoint_every = 2
keep_last = 5
"""


@pytest.fixture
def small_disk(tmp_path: Path):  # noqa: ANN201
    """A 1.6 MB file system (tmpfs): room for one checkpoint of the small test model, not two."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root and mount rights): {p.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.ranks
def test_a_checkpoint_write_on_a_full_disk_fails_every_rank_and_the_previous_one_resumes(
        tmp_path: Path, small_disk: Path) -> None:
    path = write_scenario(tmp_path, "full", world_sizes=(2,))
    body = path.read_text().replace("[train]\nsteps = 4\nglobal_batch = 6\n", CHECKPOINTS.strip() + "\n")
    body += '\n[[runs]]\nname = "resumed"\nworld_size = 2\nresume_from = "ddp2"\ntrain = { checkpoint_every = 0 }\n'
    path.write_text(body)
    s = load_scenario(path)
    out = execute("ddp2", job_for(s, "ddp2", small_disk), 2, wall_s=120, no_progress_s=60)
    assert not out.ok
    first, second = out.failure.splitlines()[:2]
    assert first.startswith("rank 0 failed while writing a checkpoint at step 4: CheckpointError: checkpoint "), first
    assert "could not be written" in first and "bytes free there" in first, first
    assert second.startswith("rank 1: a peer rank failed: rank 0 failed while writing a checkpoint at step 4")
    assert_clean(out)
    root = small_disk / "ddp2" / "checkpoints"
    assert checkpoint.complete_steps(root) == [2] and checkpoint.partials(root) == []  # the failed write is gone
    checkpoint.verify(checkpoint.resolve(root))
    resumed = execute("resumed", job_for(s, "resumed", small_disk), 2, wall_s=120, no_progress_s=60)
    assert resumed.ok, resumed.failure
    assert all(o.result["resume"]["step"] == 2 for o in resumed.ranks)
    assert all(o.result["steps"] == 6 for o in resumed.ranks)


@pytest.mark.ranks
@pytest.mark.skipif(device_baseline_kind() != JOB_START, reason="on CUDA MLX's buffers are not in RSS: "
                    "test_mlx_memory_running_away_inside_a_step_is_stopped_by_the_sampled_figure covers them")
def test_a_single_process_running_away_in_memory_is_stopped_at_its_hard_limit(tmp_path: Path) -> None:
    """Where MLX memory is host memory (CPU, Metal), an RSS limit alone stops a runaway."""
    fault = '\n[[faults]]\nrank = 0\nstep = 2\naction = "allocate"\nmb = 8192\n'
    path = write_scenario(tmp_path, "runaway", world_sizes=(1,), extra=fault)
    s = load_scenario(path)
    limits = MemoryLimits(rss_mb=300, rss_source="a test's limit")
    t0 = time.monotonic()
    out = execute("single", job_for(s, "single"), 1, wall_s=120, no_progress_s=60, memory=limits)
    assert not out.ok and out.watch.limit == "memory"
    line = out.failure.splitlines()[0]
    assert line.startswith("watchdog: rank 0 exceeded its hard memory limit after step 1: RSS "), line
    assert "above its baseline (job start: " in line and "limit 300 MB (a test's limit)" in line
    above = float(line.split("RSS ")[1].split(" MB")[0])
    assert 300 <= above < 600, line  # stopped near the limit (the line rounds to whole MB); 8 GB were on their way
    assert time.monotonic() - t0 < 60
    assert_clean(out)


ALLOCATE_THEN_HANG = """
[[faults]]
rank = 1
step = 2
action = "allocate"
mb = 1024

[[faults]]
rank = 1
step = 2
action = "hang"
"""


@pytest.mark.ranks
def test_mlx_memory_running_away_inside_a_step_is_stopped_by_the_sampled_figure(tmp_path: Path) -> None:
    """Only an MLX ceiling, and the rank hangs inside step 2 once it allocated 1 GB: no step event
    comes after the allocation (and on CUDA its RSS would not move), so only the MLX memory its
    sampler reports during the step can stop it, long before the no-progress limit."""
    path = write_scenario(tmp_path, "mlx_runaway", world_sizes=(2,), checks="max_mlx_mb = 100",
                          extra=ALLOCATE_THEN_HANG)
    s = load_scenario(path)
    limits = MemoryLimits.from_scenario(s.limits, s.checks)
    assert limits.rss_mb is None and limits.mlx_mb == 356
    t0 = time.monotonic()
    out = execute("ddp2", job_for(s, "ddp2"), 2, wall_s=120, no_progress_s=60, memory=limits)
    assert not out.ok and out.watch.limit == "memory", out.failure
    line = out.failure.splitlines()[0]
    assert line.startswith("watchdog: rank 1 exceeded its hard memory limit after step 1: MLX memory "), line
    assert "MB (sampled during the step), limit 356 MB (the ceiling [checks] max_mlx_mb = 100 + 256 MB)" in line
    value = float(line.split("MLX memory ")[1].split(" MB")[0])
    assert 356 <= value < 1024, line  # stopped on its way up
    assert time.monotonic() - t0 < 45
    assert_clean(out)


def test_hard_memory_limits_come_from_the_ceilings_or_are_set() -> None:
    m = MemoryLimits.from_scenario(LimitSpec(), CheckSpec(max_rss_mb=200))
    assert (m.rss_mb, m.mlx_mb) == (600, None) and m.rss_source == "3 x the ceiling [checks] max_rss_mb = 200"
    m = MemoryLimits.from_scenario(LimitSpec(), CheckSpec(max_rss_mb=1))  # a tight ceiling: the check's to fail
    assert m.rss_mb == 257 and m.rss_source == "the ceiling [checks] max_rss_mb = 1 + 256 MB"
    m = MemoryLimits.from_scenario(LimitSpec(hard_mlx_mb=50, hard_memory_factor=2), CheckSpec(max_mlx_mb=10))
    assert m.mlx_mb == 50 and m.mlx_source == "[limits] hard_mlx_mb"
    assert MemoryLimits.from_scenario(LimitSpec(), CheckSpec()).rss_mb is None


def _start(baseline: str = "job start", baseline_bytes: int | None = 0) -> dict:
    return {"kind": "start", "pid": os.getpid(), "rss_baseline": baseline, "rss_baseline_bytes": baseline_bytes}


def test_over_limit_names_the_rank_the_step_the_figure_the_value_and_the_limit() -> None:
    me = RankMemory()
    me.saw(0, _start())
    me.saw(0, {"kind": "step", "step": 3, "mlx_peak_bytes": 1 << 20})
    assert over_limit({0: me}, MemoryLimits(rss_mb=1e6)) is None
    line = over_limit({0: me}, MemoryLimits(rss_mb=1, rss_source="src"))
    assert line.startswith("rank 0 exceeded its hard memory limit after step 3: RSS ") and "limit 1 MB (src)" in line
    assert "MB above its baseline (job start: 0 MB), limit" in line
    assert over_limit({0: me}, MemoryLimits(mlx_mb=8)) is None
    me.saw(0, {"kind": "step", "step": 4, "mlx_peak_bytes": 64 << 20})
    assert over_limit({0: me}, MemoryLimits(mlx_mb=8, mlx_source="src")) == (
        "rank 0 exceeded its hard memory limit after step 4: MLX memory 64 MB (its peak, reported at the end "
        "of the step), limit 8 MB (src)")
    me.saw(0, {"kind": "memory", "mlx_active_bytes": 90 << 20, "mlx_peak_bytes": 90 << 20, "rss_bytes": 1})
    line = over_limit({0: me}, MemoryLimits(mlx_mb=8))
    assert "after step 4: MLX memory 90 MB (sampled during the step), limit 8 MB" in line
    line = over_limit({0: me}, MemoryLimits(machine_fraction=0.5), total_mb=2)
    assert line.startswith("the ranks together hold ") and "above 0.5 of the machine's memory (1 MB)" in line


def test_a_cuda_rank_s_rss_counts_from_the_end_of_its_first_step() -> None:
    """Until its first step ends a CUDA rank has no RSS baseline (the runtime loads that step's
    kernels): only the machine's share holds it; then the baseline its step event reports does,
    and only RSS sampled after it counts."""
    rss = psutil.Process().memory_info().rss
    me = RankMemory()
    me.saw(0, _start("end of the first step", None))
    me.saw(0, {"kind": "memory", "mlx_active_bytes": 0, "mlx_peak_bytes": 0, "rss_bytes": rss + (900 << 20)})
    limits = MemoryLimits(rss_mb=100, rss_source="src")
    assert me.rss_baseline_bytes is None and over_limit({0: me}, limits) is None
    me.saw(0, {"kind": "step", "step": 1, "mlx_peak_bytes": 0, "rss_baseline": "end of step 1",
               "rss_baseline_bytes": rss - (50 << 20)})
    assert over_limit({0: me}, limits) is None  # polled now: about 50 MB above; the 900 MB came before the baseline
    me.saw(0, {"kind": "memory", "mlx_active_bytes": 0, "mlx_peak_bytes": 0, "rss_bytes": rss + (150 << 20)})
    assert over_limit({0: me}, limits) == (
        "rank 0 exceeded its hard memory limit after step 1: RSS 200 MB above its baseline (end of step 1: "
        f"{(rss - (50 << 20)) / 2**20:.0f} MB), sampled during the step, limit 100 MB (src)")


def test_a_start_event_without_its_rss_baseline_stops_a_run_with_an_rss_limit() -> None:
    me = RankMemory()
    me.saw(2, {"kind": "start", "pid": os.getpid(), "rss_runtime_bytes": 1})
    assert over_limit({2: me}, MemoryLimits(mlx_mb=1e6)) is None  # no RSS limit: the baseline is not needed
    assert over_limit({2: me}, MemoryLimits(rss_mb=1e6)) == (
        "rank 2's start event has no rss_baseline or rss_baseline_bytes: its RSS has no baseline")


def test_an_out_that_cannot_be_written_is_refused_before_anything_launches(tmp_path: Path) -> None:
    path = write_scenario(tmp_path, "outs", world_sizes=(1,))
    (tmp_path / "afile").write_text("keep me")
    cases = [(tmp_path / "afile" / "sub", "is a file")]
    if sys.platform.startswith("linux"):
        cases.append((Path("/proc/mlx-ddp-harness-out"), "cannot be written"))
    for out, why in cases:
        t0 = time.monotonic()
        p = cli("run", str(path), "--out", str(out))
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and str(out) in lines[0] and why in lines[0], p.stderr
        assert "scenario outs" not in p.stderr and time.monotonic() - t0 < 30  # refused before any run
    assert (tmp_path / "afile").read_text() == "keep me"
