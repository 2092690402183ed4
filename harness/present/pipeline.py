"""A scenario's way through, for ``run`` and the pytest plugin alike: the scenarios this machine
can run (``available``), each planned once (``harness.scenario.plan``) and refused before any
rank starts where it cannot run (``harness.controller.preflight``), then its runs launched and
judged into the summary the tables, ``result.json`` and JUnit read (``run_and_judge``), and
written (``run_scenario``: all of it, for one scenario)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.scenario import Scenario, ScenarioError
from harness.scenario.availability import Skipped, runnable

if TYPE_CHECKING:
    from harness.controller.outcome import RunOutcome
    from harness.judge.checks import Check
    from harness.scenario.plan import ScenarioPlan

Judged = tuple[list["RunOutcome"], list["Check"], dict[str, Any]]  # outcomes, checks, the scenario's summary


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


def run_and_judge(plan: ScenarioPlan, **launch: Any) -> Judged:
    """Launch the plan's runs (``launch``: ``harness.controller.scenario_runs.run_plan``'s
    options) and judge them: (outcomes, checks, the scenario's summary)."""
    from harness.controller.scenario_runs import run_plan
    from harness.judge.verdict import judge
    from harness.present.results import scenario_summary

    outcomes = run_plan(plan, **launch)
    checks = judge(plan, outcomes)
    return outcomes, checks, scenario_summary(plan, outcomes, checks)


def run_scenario(s: Scenario, out: Path, backend: str | None = None, progress: Any = None) -> Judged:
    """One scenario all the way: planned, refused where it cannot run, launched (rank logs under
    ``out/runs``), judged, and written to ``out`` (``result.json``, ``report.md``, plots)."""
    from harness.controller.preflight import preflight
    from harness.present.report import write_outputs
    from harness.present.results import document
    from harness.scenario.plan import plan_scenario

    plan = plan_scenario(s)
    preflight(plan, backend)
    outcomes, checks, summary = run_and_judge(plan, artifacts=out / "runs", backend=backend, progress=progress)
    write_outputs(out, document([summary]))
    return outcomes, checks, summary
