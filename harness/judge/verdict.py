"""A scenario's verdict: every check of every run, each floor comparison with its floor run, and
whether each injected DDP bug was caught."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from harness.controller.outcome import RunOutcome
from harness.judge.behaviours import mark_expected_failures
from harness.judge.checks import (
    Check,
    data_share,
    expectations,
    expected_failure,
    global_rng_untouched,
    lr_schedule,
    memory_ceilings,
    rank0_side_effects,
    ranks_agree,
    replica_consistency,
    token_accounting,
    with_power,
)
from harness.judge.floors import floors
from harness.judge.parity import eval_parity, loss_parity, param_parity, step_local
from harness.judge.power import judge_power, start_parity
from harness.judge.resume_checks import judge_resume
from harness.judge.wired_share import wired_share
from harness.scenario import RunSpec, Scenario
from harness.scenario.checks import STEP_LOCAL
from harness.scenario.plan import PlannedRun, ScenarioPlan


def parity_checks(plan: ScenarioPlan, run: RunOutcome, ref: RunOutcome, by_name: dict[str, RunOutcome]) -> list[Check]:
    """Step-local parity at the reference's parameters, and the trajectories against their floor."""
    partial = plan.run(run.name).spec.stop_after is not None  # stopped early by design: compare its steps
    f = floors(plan, run.name, ref.name, by_name)
    measured = f["loss"].run
    noise = measured if measured is not None and measured.ok and not f["loss"].refused else None
    start = start_parity(run, ref, f["loss"].runs)
    out = [start, *(step_local(run, ref, plan, noise) if plan.scenario.checks.probe_every else [])]
    out.append(lr_schedule(run, ref))
    out.append(loss_parity(run, ref, f["loss"], plan, prefix=partial))
    if not partial:
        out.append(param_parity(run, ref, f["param"], plan))
        if run.result()["evals"]:
            out.append(eval_parity(run, ref, f["eval"], plan))
    return with_power(judge_power(out, run, ref, start), run, ref)


def mutation_caught(run: RunOutcome, mutation: str, checks: list[Check], margin: float) -> Check:
    """A run with an injected bug passes this check when another check failed by ``margin`` or
    more (value / limit; an exact criterion that failed counts as infinitely clear). Its failed
    checks are marked as catching it."""
    failed = [c for c in checks if not c.passed]
    for c in failed:
        c.caught = c.passed = True
    finite = sorted((c for c in failed if math.isfinite(c.margin)), key=lambda c: c.margin, reverse=True)
    exact = [c for c in failed if not math.isfinite(c.margin)]
    best = finite[0] if finite and finite[0].margin >= margin else (exact[0] if exact else None)
    also = ", ".join(f"{c.name}" + (f" ({c.margin:.3g})" if math.isfinite(c.margin) else " (exact)")
                     for c in failed if c is not best)
    if best is None:
        shown = f"; closest: {finite[0].name} at margin {finite[0].margin:.3g}" if finite else ""
        return Check("mutation_caught", run.name, False, finite[0].margin if finite else 0.0, margin,
                     f"{mutation} was not caught by any check with margin >= {margin:g}{shown}",
                     derivation="[checks].mutation_margin")
    what = f"{best.value:.3g} vs limit {best.limit:.3g}" if math.isfinite(best.margin) else \
        f"exact criterion ({best.detail})"
    detail = f"{mutation} caught by {best.name}: {what}" + (f"; also {also}" if also else "")
    return Check("mutation_caught", run.name, True, best.margin, margin, detail,
                 derivation=f"margin = value / limit of the best catching check; needs >= {margin:g} "
                            f"([checks].mutation_margin)")


def not_applicable(run: RunOutcome, checks: list[Check]) -> list[Check]:
    """The checks the run's trainer cannot support (its result names them, with why) as "n/a"."""
    na = run.result().get("not_applicable") or {}  # only trainers other than the reference name some
    return [Check(c.name, c.run, True, None, None, f"not applicable: {na[c.name]}", applicable=False)
            if c.name in na else c for c in checks]


@dataclass
class Judged:
    """What a rule judges one run with: the plan, the run and its plan, the reference run where
    it completed, every run by name, and the run's checks judged so far."""

    plan: ScenarioPlan
    run: RunOutcome
    planned: PlannedRun
    ref: RunOutcome | None
    by_name: dict[str, RunOutcome]
    so_far: list[Check]

    @property
    def s(self) -> Scenario:
        return self.plan.scenario

    @property
    def spec(self) -> RunSpec:
        return self.planned.spec

    @property
    def vs_ref(self) -> bool:
        return self.ref is not None and self.run is not self.ref


def _data_share(j: Judged) -> list[Check]:
    if not j.vs_ref or j.run.result()["data"].get("streaming"):
        return []
    train = j.planned.eff.train
    return [data_share(j.run, j.ref, j.s.checks.data_share_slack, train.global_batch // train.grad_accum)]


JUDGES: dict[str, Callable[[Judged], list[Check]]] = {
    "expected_failure": lambda j: [expected_failure(j.run, j.spec.expect_error, j.spec.expect_error_on_every_rank)],
    "parity": lambda j: parity_checks(j.plan, j.run, j.ref, j.by_name) if j.vs_ref else [],
    "data_share": _data_share,
    "every_run": lambda j: [token_accounting(j.run, j.ref if j.s.kind == "parity" else None),
                            replica_consistency(j.run), ranks_agree(j.run),
                            rank0_side_effects(j.run, j.planned.eff.trainer, j.planned.trainer),
                            global_rng_untouched(j.run)],
    "expectations": lambda j: expectations(j.run, j.spec),
    "resume": lambda j: judge_resume(j.plan, j.run, j.by_name),
    "memory": lambda j: memory_ceilings(j.run, j.s),
    "wired_share": lambda j: [wired_share(j.run)],
    "mutation": lambda j: [mutation_caught(j.run, j.spec.mutation, j.so_far, j.s.checks.mutation_margin)],
}


def _unmeasured(j: Judged, name: str) -> Check:
    """A planned check its rule could not measure on this run's results, as "n/a" with why."""
    if name in ("start_parity", "lr_schedule", "loss_parity", "param_parity", "eval_parity", *STEP_LOCAL) \
            and not j.vs_ref:
        why = f"the reference run {j.s.checks.reference} did not complete"
    elif name in ("eval_parity", "resume_eval_parity"):
        why = "the runs reported no evaluations"
    else:
        why = "the results hold nothing to measure it with"
    return Check(name, j.run.name, True, None, None, f"not measured: {why}", applicable=False)


def judge(plan: ScenarioPlan, runs: list[RunOutcome]) -> list[Check]:
    """All checks of a scenario, rule by rule (``harness.scenario.checks``): each judged run gets
    exactly its planned checks (a planned check its results cannot measure is "n/a", saying why);
    runs that did not complete get none, and floor runs are measurements, not judged."""
    s = plan.scenario
    by_name = {r.name: r for r in runs}
    ref = by_name.get(s.checks.reference) if s.checks.reference else None
    checks: list[Check] = []
    for run in runs:
        if run.floor is not None:
            continue
        planned = plan.run(run.name)
        if planned.spec.expect_error is None and not run.ok:
            continue
        j = Judged(plan, run, planned, ref if ref is not None and ref.ok else None, by_name, [])
        for rule, names in planned.checks:
            got = [c for c in JUDGES[rule.name](j) if c.name in names]
            done = {c.name for c in got}
            j.so_far += got + [_unmeasured(j, n) for n in names if n not in done]
        checks += not_applicable(run, j.so_far) if run.ok else j.so_far
    mark_expected_failures(checks, s.checks.expected_failures)
    return checks
