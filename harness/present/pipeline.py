"""A scenario's way through, for ``run`` and the pytest plugin alike: what can be refused before
any rank starts (the scenarios this machine can run, resume sources, each run's expected memory
against the budget, data files, each run's device and backend), then its runs launched and
judged into the summary the tables, ``result.json`` and JUnit read (``run_and_judge``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.memory_plan import check_launches
from harness.scenario import Scenario, ScenarioError
from harness.scenario.availability import Skipped, runnable

if TYPE_CHECKING:
    from harness.cluster_spec import Cluster
    from harness.controller.outcome import RunOutcome
    from harness.judge.checks import Check


def available(scenarios: list[Scenario]) -> tuple[list[Scenario], list[Skipped]]:
    """The scenarios (and runs) this machine can run, and what it skips; nothing left is an error."""
    kept, skipped = [], []
    for s in scenarios:
        s_kept, why = runnable(s)
        kept += [s_kept] if s_kept is not None else []
        skipped += [why] if why is not None else []
    if not kept:
        raise ScenarioError("nothing to run: " + "; ".join(s.line() for s in skipped))
    return kept, skipped


def check_resume_sources(s: Scenario) -> None:
    """A checkpoint directory a run resumes from must be complete and intact before anything starts
    (checkpoints made by earlier runs of the scenario are verified by the ranks); each trainer's
    module checks its own saves (``check_resume_source``)."""
    import importlib

    from harness.scenario.trainers import trainer_info

    names = {r.name for r in s.runs}
    for i, r in enumerate(s.runs):
        if r.resume_from is None or r.resume_from in names or r.expect_error is not None:
            continue
        eff = s.for_run(r)
        trainer = importlib.import_module(trainer_info(eff.trainer.kind).module)  # a resuming trainer's own check
        try:
            trainer.check_resume_source(Path(r.resume_from), r.resume_step, eff)
        except ValueError as e:  # CheckpointError included
            raise ScenarioError(f"{s.path}: [[runs]][{i}].resume_from: {e}") from e


def check_backends(s: Scenario, backend: str | None) -> None:
    """Refuse, before anything runs, a run whose device or backend cannot run here."""
    from harness.controller.devices import BackendRefused, DeviceRefused, plan_backend, plan_device
    from harness.scenario.trainers import cpu_collectives

    for r in s.runs:
        eff = s.for_run(r)
        try:
            device, _ = plan_device(eff.train.device)
            plan_backend(r.world_size, r.backend or backend, cpu_collectives=cpu_collectives(eff.trainer.kind),
                         device=device)
        except (BackendRefused, DeviceRefused) as e:
            raise ScenarioError(f"{s.path}: run {r.name}: {e}") from e


def preflight(s: Scenario, backend: str | None, cluster: Cluster | None = None) -> list[str]:
    """Everything about a scenario's inputs that can be refused before any rank starts (on a
    cluster, its multi-rank runs' backends are the hosts' to say); returns lines a user should
    read before the run (``check_data_files``)."""
    from harness.controller.input_checks import check_data_files
    from harness.controller.rank_budget import budget

    try:
        budget()
    except ValueError as e:
        raise ScenarioError(str(e)) from e
    check_resume_sources(s)
    check_launches(s, cluster is not None)  # each run's expected memory fits the memory budget
    notes = check_data_files(s)
    if cluster is None:
        check_backends(s, backend)
    return notes


def run_and_judge(s: Scenario, **launch: Any) -> tuple[list[RunOutcome], list[Check], dict[str, Any]]:
    """Launch the scenario's runs (``launch``: ``harness.controller.suite.run_scenario``'s options)
    and judge them: (outcomes, checks, the scenario's summary)."""
    from harness.controller.suite import run_scenario
    from harness.judge.verdict import judge
    from harness.present.results import scenario_summary

    outcomes = run_scenario(s, **launch)
    checks = judge(s, outcomes)
    return outcomes, checks, scenario_summary(s, outcomes, checks)
