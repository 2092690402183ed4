"""Run every launch a scenario describes, one after another.

Runs of one scenario share a checkpoint workspace: each run that writes checkpoints gets its
own directory there, and a run that resumes from an earlier run reads that run's directory.
The workspace lives in the system temp dir and is removed when the scenario ends; with an
artifacts directory, each checkpoint's manifest and trainer state are kept beside the rank logs
(whole checkpoints, unfinished ones included, with ``keep_checkpoints``).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from harness.controller.collect import RunOutcome
from harness.controller.session import execute
from harness.scenario import RunSpec, Scenario, writes_checkpoints

KEEP_FROM_CHECKPOINTS = ("manifest.json", "trainer.json")


def checkpoint_dir(workspace: Path, run: str) -> Path:
    return workspace / run / "checkpoints"


def train_job(s: Scenario, run: RunSpec, workspace: Path | None = None) -> dict:
    """The job file every rank of one run reads: the scenario as this run sees it."""
    eff = s.for_run(run)
    job = {
        "kind": "train",
        "run": run.name,
        "scenario": eff.to_dict(),
        "backend": run.backend,
        "faults": [dataclasses.asdict(f) for f in eff.faults],
        "stop_after": run.stop_after,
    }
    if workspace is not None and writes_checkpoints(s, run):
        job["checkpoint_dir"] = str(checkpoint_dir(workspace, run.name))
    if run.resume_from is not None:
        names = [r.name for r in s.runs]
        if run.resume_from in names and workspace is None:
            raise ValueError(f"run {run.name!r} resumes from run {run.resume_from!r}: a workspace is needed")
        source = checkpoint_dir(workspace, run.resume_from) if run.resume_from in names else Path(run.resume_from)
        job["resume"] = {"from": str(source), "step": run.resume_step}
    return job


def _keep_checkpoints(workspace: Path, dest: Path, whole: bool) -> None:
    for f in workspace.glob("*/checkpoints/*/*"):
        if whole or f.name in KEEP_FROM_CHECKPOINTS:
            target = dest / f.relative_to(workspace)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)


def run_scenario(
    s: Scenario,
    artifacts: Path | None = None,
    on_run: Callable[[RunOutcome], None] | None = None,
    keep_checkpoints: bool = False,
) -> list[RunOutcome]:
    """Launch each run of ``s``; rank logs go under ``artifacts/<scenario>/<run>`` when given."""
    outcomes = []
    workspace = Path(tempfile.mkdtemp(prefix=f"mlx-ddp-harness-{s.name}-"))
    try:
        for spec in s.runs:
            keep = artifacts / s.name / spec.name if artifacts else None
            outcome = execute(
                spec.name,
                train_job(s, spec, workspace),
                spec.world_size,
                backend=spec.backend,
                wall_s=s.limits.wall_s,
                no_progress_s=s.limits.no_progress_s,
                keep_to=keep,
            )
            outcomes.append(outcome)
            if on_run:
                on_run(outcome)
        if artifacts:
            _keep_checkpoints(workspace, artifacts / s.name, keep_checkpoints)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
    return outcomes
