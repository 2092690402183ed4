"""A scenario's way through, for ``run``, the pytest plugin and ``run_scenario_file`` alike: the
scenarios this machine can run (``available``), each planned once (``harness.scenario.plan``) and
refused before any rank starts where it cannot run (``harness.controller.preflight``; both in
``prepare``), then its runs launched and judged into the summary the tables, ``result.json`` and
JUnit read (``run_and_judge``; ``run_repeats`` for ``--repeat``), and its ``result.json``
written (``run_scenario``: all of it, for one scenario). ``harness.present`` formats what
this returns."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.scenario import Scenario, ScenarioError
from harness.scenario.availability import Skipped, runnable

if TYPE_CHECKING:
    from harness.cluster_spec import Cluster
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
    from harness.run.results import scenario_summary

    outcomes = run_plan(plan, **launch)
    checks = judge(plan, outcomes)
    return outcomes, checks, scenario_summary(plan, outcomes, checks)


def prepare(scenarios: list[Scenario], backend: str | None,
            cluster: Cluster | None = None) -> tuple[list[ScenarioPlan], list[str]]:
    """Each scenario planned and refused where it cannot run, before any rank of any starts; and
    the lines a user should read before the runs (``harness.controller.preflight``)."""
    from harness.controller.preflight import preflight
    from harness.scenario.plan import plan_scenario

    plans = [plan_scenario(s) for s in scenarios]
    notes = [line for plan in plans for line in preflight(plan, backend, cluster)]
    return plans, notes


def run_repeats(plan: ScenarioPlan, repeats: int, out: Path | None, on_repeat: Callable[[int], None],
                **launch: Any) -> dict[str, Any]:
    """The plan run ``repeats`` times (``on_repeat(k)`` as repeat k starts; rank logs under
    ``out/runs``, then ``out/runs-repeatK``), its summaries merged: every repeat's figures kept."""
    from harness.run.results import merge_repeats

    reps = []
    for k in range(1, repeats + 1):
        on_repeat(k)
        logs = out / ("runs" if k == 1 else f"runs-repeat{k}") / plan.scenario.name if out else None
        reps.append(run_and_judge(plan, artifacts=logs, **launch)[2])
    return merge_repeats(reps)


def run_scenario(s: Scenario, out: Path, backend: str | None = None,
                 progress: Any = None) -> tuple[Judged, dict[str, Any]]:
    """One scenario all the way: planned, refused where it cannot run, launched (rank logs under
    ``out/runs``), judged, and its result document written to ``out/result.json``; returns what
    was judged and the document."""
    from harness.run.results import document, write_result

    plans, _ = prepare([s], backend)
    judged = run_and_judge(plans[0], artifacts=out / "runs", backend=backend, progress=progress)
    doc = document([judged[2]])
    write_result(out, doc)
    return judged, doc
