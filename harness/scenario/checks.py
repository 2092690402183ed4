"""Which checks a run gets: one registry of check rules, each naming the checks it can give and
when it applies to a run, from the scenario alone. The collector's list (``planned_checks``),
the names a scenario may mark as expected failures (``CHECK_NAMES``) and the judge's order all
come from it; the judge (``harness.judge.verdict``) registers how each rule judges.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from harness.scenario.runs import compared
from harness.scenario.spec import RunSpec, Scenario

STEP_LOCAL = ("step_token_parity", "step_loss_parity", "step_grad_parity")
MEMORY = ("memory_rss_per_rank_mb", "memory_rss_total_mb", "memory_mlx_per_rank_mb", "memory_mlx_total_mb")


@dataclass(frozen=True)
class CheckRule:
    """A rule: the checks it can give (``names``) and those it gives one run (``plan``, from the
    scenario and the run; empty where it does not apply)."""

    name: str
    names: tuple[str, ...]
    plan: Callable[[Scenario, RunSpec], list[str]]


RULES: dict[str, CheckRule] = {}


def rule(name: str, names: tuple[str, ...]) -> Callable[[Callable[[Scenario, RunSpec], list[str]]], CheckRule]:
    """Register the rule whose plan the decorated function is (rules are judged in this order)."""

    def register(plan: Callable[[Scenario, RunSpec], list[str]]) -> CheckRule:
        if name in RULES:
            raise ValueError(f"check rule {name!r} is registered twice")
        RULES[name] = CheckRule(name, names, plan)
        return RULES[name]

    return register


def evaluates(s: Scenario, spec: RunSpec) -> bool:
    d = s.for_run(spec).data
    return bool(d.eval_rows or d.eval_path)


@rule("expected_failure", ("expected_failure",))
def _expected_failure(s: Scenario, spec: RunSpec) -> list[str]:
    return ["expected_failure"] if spec.expect_error is not None else []


@rule("parity", ("start_parity", *STEP_LOCAL, "lr_schedule", "loss_parity", "param_parity", "eval_parity"))
def _parity(s: Scenario, spec: RunSpec) -> list[str]:
    """Against the reference (a parity scenario): step-local (n/a with the reason for a trainer
    that cannot be probed), then the trajectories; a run stopped by design compares its losses."""
    if not compared(s, spec):
        return []
    names = ["start_parity", *(STEP_LOCAL if s.checks.probe_every else ()), "lr_schedule", "loss_parity"]
    if spec.stop_after is None:
        names += ["param_parity"] + (["eval_parity"] if evaluates(s, spec) else [])
    return names


@rule("data_share", ("data_share_bytes",))
def _data_share(s: Scenario, spec: RunSpec) -> list[str]:
    ref = s.run(s.checks.reference) if s.checks.reference is not None else None
    more = ref is not None and spec is not ref and spec.world_size > ref.world_size
    return ["data_share_bytes"] if more and not s.for_run(spec).data.streaming else []


@rule("every_run", ("token_accounting", "replica_consistency", "ranks_agree", "rank0_side_effects",
                    "global_rng_untouched"))
def _every_run(s: Scenario, spec: RunSpec) -> list[str]:
    return ["token_accounting", "replica_consistency", "ranks_agree", "rank0_side_effects", "global_rng_untouched"]


@rule("expectations", ("compile_scope", "stop_step"))
def _expectations(s: Scenario, spec: RunSpec) -> list[str]:
    return [n for n, v in (("compile_scope", spec.expect_compile_scope), ("stop_step", spec.expect_stop_step))
            if v is not None]


@rule("resume", ("resume_step", "resume_loss_parity", "resume_param_parity", "resume_eval_parity",
                 "resume_accounting"))
def _resume(s: Scenario, spec: RunSpec) -> list[str]:
    names = ["resume_step"] if spec.expect_resume_step is not None else []
    if spec.compare_to is not None:
        names += ["resume_loss_parity", "resume_param_parity"]
        names += ["resume_eval_parity"] if evaluates(s, spec) or evaluates(s, s.run(spec.compare_to)) else []
        names.append("resume_accounting")
    return names


@rule("memory", MEMORY)
def _memory(s: Scenario, spec: RunSpec) -> list[str]:
    c = s.checks
    limits = (c.max_rss_mb, c.max_total_rss_mb, c.max_mlx_mb, c.max_total_mlx_mb)
    return [name for name, limit in zip(MEMORY, limits, strict=True) if limit is not None]


@rule("wired_share", ("wired_share",))
def _wired_share(s: Scenario, spec: RunSpec) -> list[str]:
    """Every run: no rank holds more than its share of its machine's memory (n/a where no rank
    recorded one)."""
    return ["wired_share"]


@rule("mutation", ("mutation_caught",))
def _mutation(s: Scenario, spec: RunSpec) -> list[str]:
    return ["mutation_caught"] if spec.mutation is not None else []


CHECK_NAMES = tuple(n for r in RULES.values() for n in r.names)


def run_rules(s: Scenario, spec: RunSpec) -> list[tuple[CheckRule, list[str]]]:
    """The rules that apply to one run, in order, with the checks each gives it. A run expected to
    fail gets the expected-failure check alone."""
    if spec.expect_error is not None:
        return [(RULES["expected_failure"], ["expected_failure"])]
    return [(r, names) for r in RULES.values() if r.name != "expected_failure" and (names := r.plan(s, spec))]


def planned_checks(s: Scenario) -> dict[str, list[str]]:
    """The names of the checks each judged run of ``s`` gets, before anything runs (what a test
    collector lists); the judge gives exactly these."""
    return {spec.name: [n for _, names in run_rules(s, spec) for n in names] for spec in s.runs}
