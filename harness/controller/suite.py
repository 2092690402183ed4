"""Run every launch a scenario describes, one after another."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from harness.controller.collect import RunOutcome
from harness.controller.session import execute
from harness.scenario import RunSpec, Scenario


def train_job(s: Scenario, run: RunSpec) -> dict:
    """The job file every rank of one run reads: the scenario as this run sees it."""
    eff = s.for_run(run)
    return {
        "kind": "train",
        "run": run.name,
        "scenario": eff.to_dict(),
        "backend": run.backend,
        "faults": [dataclasses.asdict(f) for f in eff.faults],
    }


def run_scenario(
    s: Scenario,
    artifacts: Path | None = None,
    on_run: Callable[[RunOutcome], None] | None = None,
) -> list[RunOutcome]:
    """Launch each run of ``s``; rank logs go under ``artifacts/<scenario>/<run>`` when given."""
    outcomes = []
    for spec in s.runs:
        keep = artifacts / s.name / spec.name if artifacts else None
        outcome = execute(
            spec.name,
            train_job(s, spec),
            spec.world_size,
            backend=spec.backend,
            wall_s=s.limits.wall_s,
            no_progress_s=s.limits.no_progress_s,
            keep_to=keep,
        )
        outcomes.append(outcome)
        if on_run:
            on_run(outcome)
    return outcomes
