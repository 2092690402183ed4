"""What the controller refuses before any rank of a scenario starts: the rank budget, resume
sources, each run's expected memory against the budget, data files, each run's device and backend;
it returns lines a user should read before the run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from harness.memory.plan import first_launch_problem
from harness.scenario import ScenarioError

if TYPE_CHECKING:
    from harness.cluster_spec import Cluster
    from harness.scenario.plan import ScenarioPlan


def check_resume_sources(plan: ScenarioPlan) -> None:
    """A checkpoint directory a run resumes from must be complete and intact before anything starts
    (checkpoints made by earlier runs of the scenario are verified by the ranks); each trainer's
    module checks its own saves (``check_resume_source``)."""
    from harness.scenario.trainer_info import rank_module

    s = plan.scenario
    names = {r.name for r in s.runs}
    for i, run in enumerate(plan.declared):
        r = run.spec
        if r.resume_from is None or r.resume_from in names or r.expect_error is not None:
            continue
        try:
            trainer = rank_module(run.trainer.module)  # a resuming trainer's own check
            trainer.check_resume_source(Path(r.resume_from), r.resume_step, run.eff)
        except (ValueError, TypeError) as e:  # CheckpointError included; a module without run
            raise ScenarioError(f"{s.path}: [[runs]][{i}].resume_from: {e}") from e


def check_backends(plan: ScenarioPlan, backend: str | None) -> list[str]:
    """Refuse, before anything runs, a run whose device or backend cannot run here, or whose
    backend lacks a collective its trainer calls (``[trainer] collectives``); returns notes (a
    backend whose collectives could not be probed)."""
    from harness.controller.backend_ops import lacking_line, lacks
    from harness.controller.devices import BackendRefused, DeviceRefused, plan_backend, plan_device

    notes: list[str] = []
    for run in plan.declared:
        try:
            device, _ = plan_device(run.eff.train.device)
            chosen, _ = plan_backend(run.spec.world_size, run.spec.backend or backend,
                                     cpu_collectives=run.trainer.cpu_collectives, device=device)
        except (BackendRefused, DeviceRefused) as e:
            raise ScenarioError(f"{plan.scenario.path}: run {run.name}: {e}") from e
        if chosen is None or run.spec.world_size < 2:
            continue
        missing, note = lacks(chosen, run.eff.trainer.collectives)
        if missing:
            raise ScenarioError(f"{plan.scenario.path}: run {run.name}: [trainer] collectives names "
                                f"{', '.join(missing)}, which its backend cannot run: {lacking_line(chosen, missing)}")
        if note and note not in notes:
            notes.append(note)
    return notes


def preflight(plan: ScenarioPlan, backend: str | None, cluster: Cluster | None = None) -> list[str]:
    """Everything about a planned scenario that can be refused before any rank starts (on a
    cluster, its multi-rank runs' backends are the hosts' to say); returns lines a user should
    read before the run (``check_data_files``)."""
    from harness.controller import ring_yield
    from harness.controller.input_checks import check_data_files
    from harness.controller.rank_budget import budget

    check_resume_sources(plan)
    notes = check_backends(plan, backend) if cluster is None else []
    try:
        ring_yield.mode()
        budget()
    except ValueError as e:
        raise ScenarioError(str(e)) from e
    notes += check_data_files(plan.scenario, [(r.spec, r.eff.data) for r in plan.declared])
    # each run's expected memory fits the memory budget (on a cluster, multi-rank runs are the hosts' to hold)
    try:
        problem = first_launch_problem((r.name, r.spec.world_size, r.footprint) for r in plan.declared
                                       if cluster is None or r.spec.world_size == 1)
    except ValueError as e:  # a bad MLX_DDP_HARNESS_MEMORY_BUDGET
        raise ScenarioError(str(e)) from e
    if problem:
        raise ScenarioError(f"{plan.scenario.path}: {problem}")
    return notes
