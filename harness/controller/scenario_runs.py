"""Launch every run of a scenario's plan (``harness.scenario.plan``) in the plan's order: the
reference first (at its step-local probe steps it records its parameters and gradient into the
workspace, and the runs compared with it read them there), then the other runs in file order,
one after another, then the floor runs, which read nothing from each other: on the CPU one a core
at once (``side_by_side``), on a GPU one after another.

Runs of one scenario share a checkpoint workspace: each run that writes checkpoints gets its
own directory there, and a run that resumes from an earlier run reads that run's directory.
The workspace lives in the system temp dir and is removed when the scenario ends; with an
artifacts directory, each checkpoint's manifest and trainer state are kept beside the rank logs
(whole checkpoints, unfinished ones included, with ``keep_checkpoints``).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from harness.cluster_spec import Cluster
from harness.controller import kernel_cache
from harness.controller.backend_ops import lack_named
from harness.controller.devices import DeviceRefused, plan_device
from harness.controller.inputs import prepare_jobs
from harness.controller.outcome import RankOutcome, RunOutcome, WatchReport
from harness.controller.progress import Observer, RunProgress
from harness.controller.run_job import execute
from harness.controller.side_by_side import Cancel, run_side_by_side, width
from harness.memory.guard import MemoryLimits
from harness.scenario.plan import PlannedRun, ScenarioPlan
from harness.schema import NO_STEPS

KEEP_FROM_CHECKPOINTS = ("manifest.json", "trainer.json")


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


def _floors_at_once(floors: list[PlannedRun]) -> int:
    """Floor runs on the CPU go one a core at once (``side_by_side``); on a GPU, one at a time:
    they would share one device and its memory."""
    try:
        on_cpu = all(plan_device(str(r.job.device.get("asked") or "auto"))[0] == "cpu" for r in floors)
    except DeviceRefused:
        on_cpu = False
    return width(len(floors)) if on_cpu else 1


def _one_at_a_time(observer: Observer) -> Observer:
    """``observer`` called by one run's thread at a time."""
    lock = threading.Lock()

    def shown(p: RunProgress) -> None:
        with lock:
            observer(p)

    return shown


def run_plan(
    plan: ScenarioPlan,
    *,
    artifacts: Path | None = None,
    on_run: Callable[[RunOutcome], None] | None = None,
    keep_checkpoints: bool = False,
    backend: str | None = None,
    progress: Observer | None = None,
    cluster: Cluster | None = None,
) -> list[RunOutcome]:
    """Launch each run of ``plan``; rank logs go under ``artifacts/<run>`` (this scenario's
    directory) when given; ``progress`` is shown each run as it goes; runs of more than one rank
    run on ``cluster``'s hosts when given. Outcomes come back in file order, the floor runs last."""
    s = plan.scenario
    jobs = prepare_jobs(plan)
    kernel_cache.prepared()  # before any run's clock starts (a cluster's hosts keep caches of their own)
    outcomes: dict[str, RunOutcome] = {}
    workspace = Path(tempfile.mkdtemp(prefix=f"mlx-ddp-harness-{s.name}-"))
    floors = plan.floor_runs
    at_once = _floors_at_once(floors)
    shown = _one_at_a_time(progress) if progress is not None and at_once > 1 else progress

    def launch(run: PlannedRun, stop: Callable[[], None] | None = None) -> RunOutcome:
        outcome = execute(
            run.name,
            jobs[run.name].in_workspace(workspace),
            run.spec.world_size,
            backend=run.spec.backend or backend,
            wall_s=s.limits.wall_s,
            no_progress_s=s.limits.no_progress_s,
            keep_to=artifacts / run.name if artifacts else None,
            progress=shown,
            memory=MemoryLimits.from_scenario(s.limits, s.checks),
            cluster=cluster,
            sync_dirs=(workspace,),
            stop=stop,
        )
        if run.floor is not None:
            outcome.floor = run.floor.description
        lack = lack_named(outcome.backend, outcome.ranks, outcome.collectives) \
            if outcome.failure and cluster is None else None
        if lack is not None:  # a rank raised in a collective its backend lacks
            outcome.failure += "\n" + lack
        kind = run.trainer.kind
        if run.trainer.external and outcome.failure and f"trainer {kind}" not in outcome.failure:
            outcome.failure = f"trainer {kind}: {outcome.failure}"  # name the trainer under test
        return outcome

    by_name = {r.name: r for r in floors}

    def launch_floor(name: str, cancel: Cancel) -> RunOutcome:
        return launch(by_name[name], cancel.check)

    try:
        for k, run in enumerate(r for r in plan.runs if r.floor is None):  # launch order: the reference first
            outcomes[run.name] = outcome = launch(run)
            if on_run:
                on_run(outcome)
            if k == 0 and run.spec.expect_error is None and NO_STEPS in (outcome.failure or "\n").splitlines()[0]:
                why = f"run {run.name!r}: {outcome.failure.splitlines()[0]}"  # every run of its trainer would say it
                for rest in plan.runs[k + 1:]:
                    outcomes[rest.name] = not_run(rest.name, rest.spec.world_size, why)
                    if rest.floor is not None:
                        outcomes[rest.name].floor = rest.floor.description
                    if on_run:
                        on_run(outcomes[rest.name])
                break
        if at_once > 1 and not all(r.name in outcomes for r in floors):  # they read only the declared runs'
            outcomes.update(run_side_by_side(list(by_name), launch_floor, on_done=on_run, at_once=at_once))
        for run in floors:  # one at a time (a GPU's), here as the declared runs go
            if run.name not in outcomes:
                outcomes[run.name] = launch(run)
                if on_run:
                    on_run(outcomes[run.name])
        if artifacts:
            _keep_checkpoints(workspace, artifacts, keep_checkpoints)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
    return [outcomes[r.name] for r in plan.declared] + [outcomes[r.name] for r in plan.floor_runs]
