"""Run every launch a scenario describes, one after another, then its noise-floor runs.

The reference run goes first: at its step-local probe steps it records its parameters and
gradient into the workspace, and the runs compared with it read them there. Then the other runs
in file order, then the floor runs (``harness.scenario.runs``).

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

from harness.cluster_spec import Cluster
from harness.controller.inputs import prepare
from harness.controller.memory_guard import MemoryLimits
from harness.controller.outcome import RankOutcome, RunOutcome, WatchReport
from harness.controller.progress import Observer
from harness.controller.session import execute
from harness.memory_plan import job_memory
from harness.scenario import RunSpec, Scenario, writes_checkpoints
from harness.scenario.runs import FloorRun, compared, floor_runs, launch_order, probe_steps
from harness.scenario.trainers import trainer_info
from harness.schema import NO_STEPS, probe_path

KEEP_FROM_CHECKPOINTS = ("manifest.json", "trainer.json")


def checkpoint_dir(workspace: Path, run: str) -> Path:
    return workspace / run / "checkpoints"


def probe_dir(workspace: Path, s: Scenario) -> Path:
    return workspace / str(s.checks.reference) / "probes"


def probe_plan(s: Scenario, run: RunSpec, workspace: Path | None, floor: FloorRun | None = None) -> dict | None:
    """The reference records step-local probes; each compared run, and each twin or split floor
    run of the reference (the step-local noise floor), probes the steps it recorded."""
    every = s.checks.probe_every
    if workspace is None or not every or s.kind != "parity" or s.checks.reference is None:
        return None
    if not trainer_info(s.trainer.kind).probes:
        return None
    directory = probe_dir(workspace, s)
    if run.name == s.checks.reference:
        return {"mode": "record", "dir": str(directory), "steps": probe_steps(s.for_run(run).train.steps, every)}
    floor_of_ref = floor is not None and floor.kind in ("twin", "split") and floor.base == s.checks.reference
    if not (compared(s, run) if floor is None else floor_of_ref):
        return None
    steps = [k for k in probe_steps(s.for_run(run).train.steps, every) if probe_path(directory, k).exists()]
    return {"mode": "compare", "dir": str(directory), "steps": steps} if steps else None


def train_job(s: Scenario, run: RunSpec, workspace: Path | None = None, floor: FloorRun | None = None) -> dict:
    """The job file every rank of one run reads: the scenario as this run sees it. A rerun gets
    its base run's faults; a twin only its base's stop requests (part of the base's plan: the
    twin must train the steps the base trained), on its one rank; a twin of the reference is
    probed like a compared run."""
    eff = s.for_run(s.run(floor.base) if floor and floor.kind == "rerun" else run)
    faults = eff.faults
    if floor and floor.kind != "rerun":
        faults = [dataclasses.replace(f, rank=0, runs=[run.name])
                  for f in s.for_run(s.run(floor.base)).faults if f.action == "stop"]
    info = trainer_info(eff.trainer.kind)
    job = {
        "kind": "train",
        "run": run.name,
        "trainer": {"module": info.module, "hides": list(info.hides), "own_group": info.command},
        "scenario": dataclasses.replace(eff, faults=faults).to_dict(),
        "backend": run.backend,
        "faults": [dataclasses.asdict(f) for f in faults],
        "stop_after": run.stop_after,
        "mutation": run.mutation,
        "emulate": floor.emulate if floor and floor.kind == "twin" else None,
        "split_rows": floor.emulate if floor is not None and floor.kind == "split" else 0,
        "split_sample": floor.sample if floor is not None else 0,
        # rank 0 keeps the parameters the run starts from: the reference's, to measure how far training moved them
        "keep_start": floor is None and run.name == s.checks.reference,
        "probe": probe_plan(s, run, workspace, floor),
        "device": {"asked": eff.train.device},  # planned at launch (``session.execute``)
        "memory": job_memory(s, run),  # the budget and expected peak; ranks per host added at launch
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


def not_run(name: str, world_size: int, why: str) -> RunOutcome:
    """A run left out because an earlier one showed it could not train (``why``)."""
    ranks = [RankOutcome(r, None, False, None, [], "") for r in range(world_size)]
    return RunOutcome(name, world_size, None, False, f"not run: {why}", ranks, WatchReport(0.0, None))


def _keep_checkpoints(workspace: Path, dest: Path, whole: bool) -> None:
    for f in workspace.glob("*/checkpoints/*/*"):
        if whole or f.name in KEEP_FROM_CHECKPOINTS:
            target = dest / f.relative_to(workspace)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)


def run_scenario(
    s: Scenario,
    *,
    artifacts: Path | None = None,
    on_run: Callable[[RunOutcome], None] | None = None,
    keep_checkpoints: bool = False,
    backend: str | None = None,
    progress: Observer | None = None,
    cluster: Cluster | None = None,
) -> list[RunOutcome]:
    """Launch each run of ``s``, then its floor runs; rank logs go under ``artifacts/<run>`` (this
    scenario's directory) when given; ``progress`` is shown each run as it goes; runs of more than one rank run on
    ``cluster``'s hosts when given. Outcomes come back in file order, the floor runs last."""
    s = prepare(s)
    outcomes: dict[str, RunOutcome] = {}
    workspace = Path(tempfile.mkdtemp(prefix=f"mlx-ddp-harness-{s.name}-"))
    floors = floor_runs(s)
    try:
        pending = [*((r, None) for r in launch_order(s)), *((f.spec(s), f) for f in floors)]
        for k, (spec, floor) in enumerate(pending):
            keep = artifacts / spec.name if artifacts else None
            outcome = execute(
                spec.name,
                train_job(s, spec, workspace, floor),
                spec.world_size,
                backend=spec.backend or backend,
                wall_s=s.limits.wall_s,
                no_progress_s=s.limits.no_progress_s,
                keep_to=keep,
                progress=progress,
                memory=MemoryLimits.from_scenario(s.limits, s.checks),
                cluster=cluster,
                sync_dirs=(workspace,),
            )
            if floor is not None:
                outcome.floor = floor.description
            t = s.for_run(spec).trainer
            if trainer_info(t.kind).external and outcome.failure and f"trainer {t.kind}" not in outcome.failure:
                outcome.failure = f"trainer {t.kind}: {outcome.failure}"  # name the trainer under test
            outcomes[spec.name] = outcome
            if on_run:
                on_run(outcome)
            if k == 0 and spec.expect_error is None and NO_STEPS in (outcome.failure or "\n").splitlines()[0]:
                why = f"run {spec.name!r}: {outcome.failure.splitlines()[0]}"  # every run of its trainer would say it
                for rest, rest_floor in pending[k + 1:]:
                    outcomes[rest.name] = not_run(rest.name, rest.world_size, why)
                    if rest_floor is not None:
                        outcomes[rest.name].floor = rest_floor.description
                    if on_run:
                        on_run(outcomes[rest.name])
                break
        if artifacts:
            _keep_checkpoints(workspace, artifacts, keep_checkpoints)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
    return [outcomes[r.name] for r in s.runs] + [outcomes[f.name] for f in floors]
