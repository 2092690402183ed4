"""A scenario's verdict: every check of every run, each floor comparison with its floor run, and
whether each injected DDP bug was caught."""

from __future__ import annotations

import importlib

from harness.controller.outcome import RunOutcome
from harness.judge.behaviours import mark_expected_failures
from harness.judge.checks import Check
from harness.judge.collectives import point_to_divergence
from harness.judge.families import FamilyJudge, Judged
from harness.scenario.checks import CheckFamily
from harness.scenario.plan import ScenarioPlan


def judge_of(family: CheckFamily) -> FamilyJudge:
    """The function ``family.judge`` names (``"module:function"``), imported on first use."""
    module, _, name = family.judge.partition(":")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"check family {family.name}: its judge {family.judge} does not resolve: {e}") from e
    if not callable(found):
        raise ValueError(f"check family {family.name}: its judge {family.judge} is not a function")
    return found


def not_applicable(run: RunOutcome, checks: list[Check]) -> list[Check]:
    """The checks the run's trainer cannot support (its result names them, with why) as "n/a"."""
    na = run.result().get("not_applicable") or {}  # only trainers other than the reference name some
    return [Check(c.name, c.run, True, None, None, f"not applicable: {na[c.name]}", applicable=False)
            if c.name in na else c for c in checks]


def _unmeasured(j: Judged, family: CheckFamily, name: str) -> Check:
    """A planned check its family could not measure on this run's results, as "n/a" with why."""
    if family.needs_reference and not j.vs_ref:
        why = f"the reference run {j.s.checks.reference} did not complete"
    else:
        why = family.why_unmeasured(name)
    return Check(name, j.run.name, True, None, None, f"not measured: {why}", applicable=False)


def judge(plan: ScenarioPlan, runs: list[RunOutcome]) -> list[Check]:
    """All checks of a scenario, family by family (``harness.scenario.checks``): each judged run
    gets exactly its planned checks (a planned check its results cannot measure is "n/a", saying
    why); runs that did not complete get none, and floor runs are measurements, not judged."""
    s = plan.scenario
    by_name = {r.name: r for r in runs}
    ref = by_name.get(s.checks.reference) if s.checks.reference else None
    checks: list[Check] = []
    for run in runs:
        if run.floor is not None:
            continue
        planned = plan.run(run.name)
        if not planned.spec.fails_by_design and not run.ok:
            continue
        j = Judged(plan, run, planned, ref if ref is not None and ref.ok else None, by_name, [])
        for family, names in planned.checks:
            got = [c for c in judge_of(family)(j) if c.name in names]
            done = {c.name for c in got}
            got += [_unmeasured(j, family, n) for n in names if n not in done]
            # n/a as each family is judged: a later family (``mutation``) must not count them as failures
            j.so_far += not_applicable(run, got) if run.ok else got
        checks += j.so_far
    mark_expected_failures(checks, s.checks.expected_failures)
    for run in runs:
        point_to_divergence(run, [c for c in checks if c.run == run.name])
    return checks
