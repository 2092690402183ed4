"""A rank's time before its first step, by part: the runtime's own parts, then the trainer's phases."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from harness.rank.entry import loads_first_step_kernels
from harness.rank.startup import StartupClock
from tests.conftest import cli, write_scenario


def test_the_clock_splits_launch_to_training_into_parts() -> None:
    clock = StartupClock(time.time() - 0.5)
    for part in ("device", "warm_up", "libraries"):
        clock.done(part)
    time.sleep(0.02)
    clock.phase("data")
    clock.phase("model")
    time.sleep(0.03)
    clock.phase("train")
    clock.phase("save")  # after training began: not start-up
    f = clock.figures()
    parts = f["startup_parts_s"]
    assert list(parts)[:4] == ["spawn", "device", "warm_up", "libraries"] and parts["spawn"] >= 0.5
    assert parts["trainer"] >= 0.02 and parts["model"] >= 0.03 and "train" not in parts and "save" not in parts
    assert abs(f["startup_total_s"] - sum(parts.values())) < 1e-3


def test_the_warm_up_loads_a_first_steps_kernels_only_where_the_rss_baseline_is_job_start() -> None:
    # Metal: the baseline is what the rank held before its job, so it must hold them; CUDA: the
    # baseline is the end of step 1, which holds them anyway; a CPU has none to load
    assert loads_first_step_kernels("metal")
    assert not loads_first_step_kernels("cuda")
    assert not loads_first_step_kernels("cpu")


@pytest.mark.ranks
def test_every_run_reports_its_startup_by_part(tmp_path: Path) -> None:
    path = write_scenario(tmp_path, "startup", world_sizes=(1, 2), steps=2)
    p = cli("run", str(path), "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    (s,) = json.loads((tmp_path / "out" / "result.json").read_text())["scenarios"]
    for run in s["runs"]:
        st = run["startup"]
        assert {"spawn", "device", "warm_up", "libraries", "trainer", "data", "model"} <= set(st["parts_s"]), st
        assert 0 < st["total_s"] <= run["wall_s"] - run["runtime_s"] + 0.05, (st, run["wall_s"], run["runtime_s"])
        assert st["first_step_extra_s"] is not None
        assert st["libraries_loaded"] == ["mlx_lm"], st  # its architectures only: no transformers, no torch
        for rank in run["ranks"]:
            assert rank["startup_total_s"] <= st["total_s"]


def test_a_rank_imports_neither_the_scenario_loader_nor_the_trainer_registry() -> None:
    """The registry's entry points cost a scan of every installed package's metadata (about 50 ms
    of each rank's start): the job carries the names a rank reports (``TrainerRef.heavy``)."""
    import subprocess
    import sys

    from harness.scenario import load_scenario
    from harness.scenario.plan import plan_scenario
    from harness.scenario.trainers import heavy_libraries
    from tests.conftest import REPO

    code = ("import sys, harness.rank.entry, harness.trainers.reference.trainer; "
            "print(sorted(m for m in ('harness.scenario.load', 'harness.scenario.trainers', 'importlib.metadata') "
            "if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr
    job = plan_scenario(load_scenario(REPO / "examples" / "minimal_parity.toml")).run("ddp2").job
    assert job.trainer.heavy == heavy_libraries() and "transformers" in job.trainer.heavy
    assert StartupClock(None, ("json", "no_such_library")).figures()["libraries_loaded"] == ["json"]
