"""How each built-in check family judges one run: the function its record names
(``harness.scenario.checks.CheckFamily.judge``), taking the run's ``Judged`` context and returning
its checks (a planned check it returns none for is "n/a", ``harness.judge.verdict``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from harness.controller.outcome import RunOutcome
from harness.judge import checks as run_checks
from harness.judge import memory_checks
from harness.judge.checks import Check, with_power
from harness.judge.collectives import collective_agreement
from harness.judge.defects import TRAJECTORIES, unnamed_trajectory
from harness.judge.floors import floors
from harness.judge.parity import eval_parity, loss_parity, param_parity, step_local
from harness.judge.power import judge_power, start_parity
from harness.judge.resume_checks import judge_resume
from harness.judge.timed_mutations import rank_failure_named, straggler_passed
from harness.scenario import RunSpec, Scenario
from harness.scenario.checks import CheckName
from harness.scenario.names import MUTATION_EXPECTS
from harness.scenario.plan import PlannedRun, ScenarioPlan


@dataclass
class Judged:
    """What a family judges one run with: the plan, the run and its plan, the reference run where
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


class FamilyJudge(Protocol):
    """A check family's judge, the function its ``CheckFamily.judge`` names (``"module:function"``):
    the family's checks of one run (``Judged``); a planned check it leaves out is "n/a", not
    measured (``harness.judge.verdict``)."""

    def __call__(self, j: Judged) -> list[Check]: ...


def parity_checks(plan: ScenarioPlan, run: RunOutcome, ref: RunOutcome, by_name: dict[str, RunOutcome]) -> list[Check]:
    """Step-local parity at the reference's parameters, and the trajectories against their floor."""
    partial = plan.run(run.name).spec.stop_after is not None  # stopped early by design: compare its steps
    f = floors(plan, run.name, ref.name, by_name)
    measured = f["loss"].run
    noise = measured if measured is not None and measured.ok and not f["loss"].refused else None
    start = start_parity(run, ref, f["loss"].runs)
    out = [start, *(step_local(run, ref, plan, noise) if plan.scenario.checks.probe_every else [])]
    out.append(run_checks.lr_schedule(run, ref))
    out.append(loss_parity(run, ref, f["loss"], plan, prefix=partial))
    if not partial:
        out.append(param_parity(run, ref, f["param"], plan))
        if run.result()["evals"]:
            out.append(eval_parity(run, ref, f["eval"], plan))
    out = with_power(judge_power(out, run, ref, start), run, ref)
    hint = unnamed_trajectory(out, plan.scenario.checks.probe_every, run.result().get("not_applicable") or {})
    for c in out:
        if hint and c.name in TRAJECTORIES and not c.passed:
            c.detail += f"; {hint}"
    return out


def mutation_caught(run: RunOutcome, mutation: str, checks: list[Check], margin: float) -> Check:
    """A run with an injected bug passes this check when another check failed by ``margin`` or
    more (value / limit; an exact criterion that failed counts as infinitely clear). Its failed
    checks are marked as catching it."""
    failed = [c for c in checks if not c.passed and not c.no_power]  # a check without power catches nothing
    for c in failed:
        c.caught = c.passed = True
    finite = sorted((c for c in failed if math.isfinite(c.margin)), key=lambda c: c.margin, reverse=True)
    exact = [c for c in failed if not math.isfinite(c.margin)]
    best = finite[0] if finite and finite[0].margin >= margin else (exact[0] if exact else None)
    also = ", ".join(f"{c.name}" + (f" ({c.margin:.3g})" if math.isfinite(c.margin) else " (exact)")
                     for c in failed if c is not best)
    if best is None:
        shown = f"; closest: {finite[0].name} at margin {finite[0].margin:.3g}" if finite else ""
        return Check(CheckName.mutation_caught, run.name, False, finite[0].margin if finite else 0.0, margin,
                     f"{mutation} was not caught by any check with margin >= {margin:g}{shown}",
                     derivation="[checks].mutation_margin")
    what = f"{best.value:.3g} vs limit {best.limit:.3g}" if math.isfinite(best.margin) else \
        f"exact criterion ({best.detail})"
    detail = f"{mutation} caught by {best.name}: {what}" + (f"; also {also}" if also else "")
    return Check(CheckName.mutation_caught, run.name, True, best.margin, margin, detail,
                 derivation=f"margin = value / limit of the best catching check; needs >= {margin:g} "
                            f"([checks].mutation_margin)")


def expected_failure(j: Judged) -> list[Check]:
    return [run_checks.expected_failure(j.run, j.spec.expect_error, j.spec.expect_error_on_every_rank)]


def parity(j: Judged) -> list[Check]:
    return parity_checks(j.plan, j.run, j.ref, j.by_name) if j.vs_ref else []


def data_share(j: Judged) -> list[Check]:
    if not j.vs_ref or j.run.result()["data"].get("streaming"):
        return []
    train = j.planned.eff.train
    return [run_checks.data_share(j.run, j.ref, j.s.checks.data_share_slack, train.global_batch // train.grad_accum)]


def every_run(j: Judged) -> list[Check]:
    return [run_checks.token_accounting(j.run, j.ref if j.s.kind == "parity" else None),
            run_checks.replica_consistency(j.run), run_checks.ranks_agree(j.run),
            run_checks.rank0_side_effects(j.run, j.planned.eff.trainer, j.planned.trainer),
            run_checks.global_rng_untouched(j.run), run_checks.dtype_held(j.run)]


def collectives(j: Judged) -> list[Check]:
    return [collective_agreement(j.run)]


def expectations(j: Judged) -> list[Check]:
    return run_checks.expectations(j.run, j.spec)


def resume(j: Judged) -> list[Check]:
    return judge_resume(j.plan, j.run, j.by_name)


def memory(j: Judged) -> list[Check]:
    return memory_checks.memory_ceilings(j.run, j.s)


def wired_share(j: Judged) -> list[Check]:
    return [memory_checks.wired_share(j.run)]


def mutation(j: Judged) -> list[Check]:
    expects = MUTATION_EXPECTS.get(j.spec.mutation, "caught")
    if expects == "pass":
        return [straggler_passed(j.run, j.spec.mutation, j.so_far)]
    if expects == "rank_failure":
        return [rank_failure_named(j.run, j.spec.mutation)]
    return [mutation_caught(j.run, j.spec.mutation, j.so_far, j.s.checks.mutation_margin)]
