"""A scenario's verdict: every check of every run, each floor comparison with its floor run, and
whether each injected DDP bug was caught."""

from __future__ import annotations

import math

from harness.controller.collect import RunOutcome
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
from harness.judge.resume_checks import judge_resume
from harness.scenario import RunSpec, Scenario


def parity_checks(s: Scenario, run: RunOutcome, ref: RunOutcome, by_name: dict[str, RunOutcome]) -> list[Check]:
    """Step-local parity at the reference's parameters, and the trajectories against their floor."""
    spec = s.run(run.name)
    partial = spec.stop_after is not None  # stopped early by design: compare its steps
    f = floors(s, spec, s.run(ref.name), by_name)
    measured = f["loss"].run
    noise = measured if measured is not None and measured.ok and not f["loss"].refused else None
    out = step_local(run, ref, s, noise) if s.checks.probe_every else []
    out.append(lr_schedule(run, ref))
    out.append(loss_parity(run, ref, f["loss"], s, prefix=partial))
    if not partial:
        out.append(param_parity(run, ref, f["param"], s))
        if run.result().get("evals"):
            out.append(eval_parity(run, ref, f["eval"], s))
    return with_power(out, run, ref)


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
    na = run.result().get("not_applicable") or {}
    return [Check(c.name, c.run, True, None, None, f"not applicable: {na[c.name]}", applicable=False)
            if c.name in na else c for c in checks]


def judge(s: Scenario, runs: list[RunOutcome]) -> list[Check]:
    """All checks of a scenario; runs expected to fail get only the expected-failure check, and
    floor runs are measurements, not judged."""
    by_name = {r.name: r for r in runs}
    ref = by_name.get(s.checks.reference) if s.checks.reference else None
    checks: list[Check] = []
    for run in runs:
        if run.floor is not None:
            continue
        spec = s.run(run.name)
        if spec.expect_error is not None:
            checks.append(expected_failure(run, spec.expect_error, spec.expect_error_on_every_rank))
            continue
        if not run.ok:
            continue
        vs_ref = ref is not None and run is not ref and ref.ok
        parity = s.kind == "parity"  # a throughput scenario's runs may train at other global batches
        mine = parity_checks(s, run, ref, by_name) if vs_ref and parity else []
        if vs_ref and run.world_size > ref.world_size and not run.result().get("data", {}).get("streaming"):
            train = s.for_run(spec).train
            mine.append(data_share(run, ref, s.checks.data_share_slack, train.global_batch // train.grad_accum))
        mine.append(token_accounting(run, ref if ref is not None and ref.ok and parity else None))
        mine += [replica_consistency(run), ranks_agree(run), rank0_side_effects(run, s.for_run(spec).trainer),
                 global_rng_untouched(run)]
        mine += expectations(run, spec)
        mine += judge_resume(s, run, by_name)
        mine += memory_ceilings(run, s)
        if spec.mutation is not None:
            mine.append(mutation_caught(run, spec.mutation, mine, s.checks.mutation_margin))
        checks += not_applicable(run, mine)
    mark_expected_failures(checks, s.checks.expected_failures)
    return checks


def planned_checks(s: Scenario) -> dict[str, list[str]]:
    """The names of the checks ``judge`` gives each judged run of ``s``, from the scenario alone
    (before anything runs): what a test collector lists. A check the results add (or leave out)
    is reconciled when the verdict is known."""
    from harness.run_plan import compared

    c = s.checks
    plan: dict[str, list[str]] = {}

    def evaluates(spec: RunSpec) -> bool:
        d = s.for_run(spec).data
        return bool(d.eval_rows or d.eval_path)

    for spec in s.runs:
        if spec.expect_error is not None:
            plan[spec.name] = ["expected_failure"]
            continue
        eff = s.for_run(spec)
        has_evals = evaluates(spec)
        names: list[str] = []
        ref = s.run(c.reference) if c.reference is not None else None
        if compared(s, spec):
            if c.probe_every:  # "n/a" with the reason for a trainer that cannot be probed
                names += ["step_token_parity", "step_loss_parity", "step_grad_parity"]
            names += ["lr_schedule", "loss_parity"]
            if spec.stop_after is None:
                names += ["param_parity"] + (["eval_parity"] if has_evals else [])
        if ref is not None and spec is not ref and spec.world_size > ref.world_size and not eff.data.streaming:
            names.append("data_share_bytes")
        names += ["token_accounting", "replica_consistency", "ranks_agree", "rank0_side_effects",
                  "global_rng_untouched"]
        names += [n for n, v in (("compile_scope", spec.expect_compile_scope), ("stop_step", spec.expect_stop_step))
                  if v is not None]
        if spec.expect_resume_step is not None:
            names.append("resume_step")
        if spec.compare_to is not None:
            names += ["resume_loss_parity", "resume_param_parity"]
            names += ["resume_eval_parity"] if has_evals or evaluates(s.run(spec.compare_to)) else []
            names.append("resume_accounting")
        for label, per_rank, total in (("rss", c.max_rss_mb, c.max_total_rss_mb), ("mlx", c.max_mlx_mb,
                                                                                  c.max_total_mlx_mb)):
            names += [f"memory_{label}_per_rank_mb"] if per_rank is not None else []
            names += [f"memory_{label}_total_mb"] if total is not None else []
        if spec.mutation is not None:
            names.append("mutation_caught")
        plan[spec.name] = names
    return plan
