"""Which checks a run gets: one record per check family (``CheckFamily``), each naming the checks it
can give, which of them a run gets (from the scenario alone), the function that judges them, those
that carry power and why each is "n/a" when its judge did not measure it. Every built-in check's
name is written once, as a ``CheckName`` member (defined in ``harness.scenario.names``, the lowest
layer, so that a module importing nothing else of the harness can name a check; import it from
here). The collector's list (``plan_scenario(s).checks()``), the names a scenario may mark as
expected failures (``check_names``) and the judge's order all come from the registry
(``families``): the built-in families, then those other packages declare under the entry points
``mlx_ddp_harness.checks`` (``toy = my_pkg.checks:FAMILY``), loaded on first use. This module
never imports the judge: a family names its judge as ``"module:function"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Protocol

from harness.scenario.names import CheckName
from harness.scenario.spec import RunSpec, Scenario, ScenarioError, compared

ENTRY_POINTS = "mlx_ddp_harness.checks"
NOTHING_TO_MEASURE = "the results hold nothing to measure it with"
NO_EVALS = "the runs reported no evaluations"


N = CheckName
STEP_LOCAL = (N.step_token_parity, N.step_loss_parity, N.step_grad_parity)
MEMORY = (N.memory_rss_per_rank_mb, N.memory_rss_total_mb, N.memory_mlx_per_rank_mb, N.memory_mlx_total_mb)


class Applies(Protocol):
    """Which of a family's checks one run gets (plain names; none where the family does not
    apply), from the scenario and the run alone, so that a collector lists them before anything
    runs."""

    def __call__(self, s: Scenario, spec: RunSpec) -> list[str]: ...


@dataclass(frozen=True, eq=False)
class CheckFamily:
    """A family of checks: the checks it can give (``checks``) and those one run gets
    (``applies``, from the scenario and the run; empty where it does not apply); its judge,
    ``"module:function"`` taking the judge's context of one run (``harness.judge.families.Judged``)
    and returning ``Check``s; its checks that carry power (``powered``); whether its checks are
    "n/a" when the reference did not complete (``needs_reference``); why a check is "n/a" when its
    judge did not measure it (``unmeasured``; else "the results hold nothing to measure it with");
    what it checks, in one line (``doc``, in docs/checks.md). ``judged_last``: judged after every
    other family (it reads their checks). ``reads_params``: its checks that read the runs' final
    parameters (None, a family that does not say: any of them may), so that a scenario none of
    whose checks reads them leaves them unsaved (``harness.scenario.plan``). ``compares_starts``:
    its checks that compare where one run's training starts with where another's does (the replica
    digest before the first step; None: any of them may), so that a one-rank run whose start no
    check compares does not digest it (a run of more ranks does: ``replica_consistency`` compares
    its ranks' starts)."""

    name: str
    checks: tuple[str, ...]
    applies: Applies
    judge: str
    doc: str
    powered: tuple[str, ...] = ()
    needs_reference: bool = False
    unmeasured: Mapping[str, str] = field(default_factory=dict)
    judged_last: bool = False
    reads_params: tuple[str, ...] | None = None
    compares_starts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", str(self.name))  # a CheckName member as a plain name
        declared = (*self.powered, *self.unmeasured, *(self.reads_params or ()), *(self.compares_starts or ()))
        stray = [n for n in declared if n not in self.checks]
        if stray or ":" not in self.judge:
            raise ValueError(f"check family {self.name!r}: " + (f"{', '.join(stray)} not among its checks" if stray
                                                                 else f"judge {self.judge!r} is not 'module:function'"))

    def why_unmeasured(self, name: str) -> str:
        return self.unmeasured.get(name, NOTHING_TO_MEASURE)

    def reads_params_in(self, names: tuple[str, ...] | list[str]) -> bool:
        """Whether any of ``names``, checks a run gets of this family, reads final parameters."""
        return _among(names, self.reads_params)

    def compares_starts_in(self, names: tuple[str, ...] | list[str]) -> bool:
        """Whether any of ``names``, checks a run gets of this family, compares runs' starts."""
        return _among(names, self.compares_starts)


def _among(names: tuple[str, ...] | list[str], declared: tuple[str, ...] | None) -> bool:
    """Whether any of ``names`` is among ``declared`` (None: a family that does not say, any)."""
    return bool(names) and (declared is None or bool(set(names) & set(declared)))


def evaluates(s: Scenario, spec: RunSpec) -> bool:
    d = s.for_run(spec).data
    return bool(d.eval_rows or d.eval_path)


def _expected_failure(s: Scenario, spec: RunSpec) -> list[str]:
    return [N.expected_failure] if spec.expect_error is not None else []


def _parity(s: Scenario, spec: RunSpec) -> list[str]:
    """Against the reference (a parity scenario): step-local (n/a with the reason for a trainer
    that cannot be probed), then the trajectories; a run stopped by design compares its losses."""
    if not compared(s, spec):
        return []
    names = [N.start_parity, *(STEP_LOCAL if s.checks.probe_every else ()), N.lr_schedule, N.loss_parity]
    if spec.stop_after is None:
        names += [N.param_parity] + ([N.eval_parity] if evaluates(s, spec) else [])
    return names


def _data_share(s: Scenario, spec: RunSpec) -> list[str]:
    ref = s.run(s.checks.reference) if s.checks.reference is not None else None
    more = ref is not None and spec is not ref and spec.world_size > ref.world_size
    return [N.data_share_bytes] if more and not s.for_run(spec).data.streaming else []


EVERY_RUN = (N.token_accounting, N.replica_consistency, N.ranks_agree, N.rank0_side_effects, N.global_rng_untouched,
             N.dtype_held)


def _every_run(s: Scenario, spec: RunSpec) -> list[str]:
    return list(EVERY_RUN)


def _collectives(s: Scenario, spec: RunSpec) -> list[str]:
    return [N.collective_agreement] if spec.world_size > 1 else []


def _expectations(s: Scenario, spec: RunSpec) -> list[str]:
    return [n for n, v in ((N.compile_scope, spec.expect_compile_scope), (N.stop_step, spec.expect_stop_step))
            if v is not None]


def _resume(s: Scenario, spec: RunSpec) -> list[str]:
    names = [N.resume_step] if spec.expect_resume_step is not None else []
    if spec.compare_to is not None:
        names += [N.resume_loss_parity, N.resume_param_parity]
        names += [N.resume_eval_parity] if evaluates(s, spec) or evaluates(s, s.run(spec.compare_to)) else []
        names.append(N.resume_accounting)
    return names


def _memory(s: Scenario, spec: RunSpec) -> list[str]:
    c = s.checks
    limits = (c.max_rss_mb, c.max_total_rss_mb, c.max_mlx_mb, c.max_total_mlx_mb)
    return [name for name, limit in zip(MEMORY, limits, strict=True) if limit is not None]


def _wired_share(s: Scenario, spec: RunSpec) -> list[str]:
    """Every run: no rank holds more than its share of its machine's memory (n/a where no rank
    recorded one)."""
    return [N.wired_share]


def _mutation(s: Scenario, spec: RunSpec) -> list[str]:
    return [N.mutation_caught] if spec.mutation is not None else []


JUDGES = "harness.judge.families"
READS_NEITHER = {"reads_params": (), "compares_starts": ()}  # a family that reads no parameters, compares no starts
BUILTIN = (  # in judging order
    CheckFamily(N.expected_failure, (N.expected_failure,), _expected_failure, f"{JUDGES}:expected_failure",
                "A run that must fail failed, with the expected error in its message, and left no process behind.",
                **READS_NEITHER),
    CheckFamily("parity", (N.start_parity, *STEP_LOCAL, N.lr_schedule, N.loss_parity, N.param_parity, N.eval_parity),
                _parity, f"{JUDGES}:parity",
                "A compared run matches the reference: the same start, step-local parity at its probe steps, the "
                "learning-rate schedule, and the loss, final parameters and evals against their floor.",
                powered=(N.step_loss_parity, N.step_grad_parity, N.loss_parity, N.param_parity, N.eval_parity),
                needs_reference=True, unmeasured={N.eval_parity: NO_EVALS}, reads_params=(N.param_parity,),
                compares_starts=(N.start_parity,)),
    CheckFamily("data_share", (N.data_share_bytes,), _data_share, f"{JUDGES}:data_share",
                "Each rank of a run of more ranks than the reference holds about its share of the data bytes.",
                **READS_NEITHER),
    CheckFamily("every_run", EVERY_RUN, _every_run, f"{JUDGES}:every_run",
                "Every run: its tokens add up, its replicas stay identical and its ranks agree (at more than one "
                "rank), its side effects happen on rank 0 only, training leaves the global RNGs untouched, and every "
                "trained parameter keeps its dtype.", **READS_NEITHER),
    CheckFamily("collectives", (N.collective_agreement,), _collectives, f"{JUDGES}:collectives",
                "Every run of more than one rank: its ranks issued the same collectives (op, shape, dtype, group) "
                "in the same order, or the first that differs is named with each side's call site and step.",
                **READS_NEITHER),
    CheckFamily("expectations", (N.compile_scope, N.stop_step), _expectations, f"{JUDGES}:expectations",
                "Every rank reports what the run expects of it: its compile scope, the step it stopped at.",
                **READS_NEITHER),
    CheckFamily("resume", (N.resume_step, N.resume_loss_parity, N.resume_param_parity, N.resume_eval_parity,
                           N.resume_accounting), _resume, f"{JUDGES}:resume",
                "A resumed run restored the expected step and reproduces the run it is compared to: its losses, "
                "final parameters, evals, tokens and speed.",
                powered=(N.resume_loss_parity, N.resume_param_parity, N.resume_eval_parity),
                unmeasured={N.resume_eval_parity: NO_EVALS}, reads_params=(N.resume_param_parity,),
                compares_starts=()),
    CheckFamily("memory", MEMORY, _memory, f"{JUDGES}:memory",
                "Peak RSS and MLX memory, of the largest rank and summed over ranks, stay under the scenario's "
                "ceilings.", **READS_NEITHER),
    CheckFamily(N.wired_share, (N.wired_share,), _wired_share, f"{JUDGES}:wired_share",
                "No rank holds more than its share of its machine's memory.", **READS_NEITHER),
    CheckFamily("mutation", (N.mutation_caught,), _mutation, f"{JUDGES}:mutation",
                "A run with an injected DDP bug has it caught: another of its checks failed by the required margin "
                "(a straggler: every other check passed and the wait shows; a rank killed: the run names it).",
                judged_last=True, **READS_NEITHER),
)

FAMILIES: dict[str, CheckFamily] = {}  # by name, in judging order: read it through families()
_declared = False  # whether the entry points' families are loaded


def _add(known: dict[str, CheckFamily], family: CheckFamily) -> None:
    """Add ``family`` to ``known`` before the families judged last (unless it is one)."""
    if family.name in known:
        raise ValueError(f"check family {family.name!r} is registered twice")
    taken = sorted(set(family.checks) & {n for f in known.values() for n in f.checks})
    if taken:
        raise ValueError(f"check family {family.name!r}: {', '.join(taken)} already registered by another family")
    last = [] if family.judged_last else [known.pop(f.name) for f in list(known.values()) if f.judged_last]
    known[family.name] = family
    known.update((f.name, f) for f in last)


def _load() -> dict[str, CheckFamily]:
    """The built-in families, then those other packages declare (loaded once, on first use; a bad
    entry point is refused, in one line, on every use)."""
    global _declared
    if not _declared:
        trial = dict(FAMILIES)
        for ep in metadata.entry_points(group=ENTRY_POINTS):
            where = f"check family entry point {ep.name} = {ep.value}"
            try:
                declared = ep.load()
            except Exception as e:  # noqa: BLE001 - named, one line, where a scenario asks for it
                raise ScenarioError(f"{where}: cannot load it: {type(e).__name__}: {e}") from e
            if not isinstance(declared, CheckFamily) or declared.name != ep.name:
                raise ScenarioError(f"{where}: not a CheckFamily named {ep.name!r}")
            try:
                _add(trial, declared)
            except ValueError as e:
                raise ScenarioError(f"{where}: {e}") from e
        FAMILIES.clear()
        FAMILIES.update(trial)
        _declared = True
    return FAMILIES


for _f in BUILTIN:
    _add(FAMILIES, _f)


def register(family: CheckFamily) -> CheckFamily:
    """Add a check family (a family name, or a check name, registered already is refused)."""
    _add(_load(), family)
    return family


def unregister(name: str) -> None:
    _load().pop(name, None)


def families() -> tuple[CheckFamily, ...]:
    """Every registered check family, in judging order."""
    return tuple(_load().values())


def family(name: str) -> CheckFamily:
    return _load()[name]


def check_names() -> tuple[str, ...]:
    """Every check's name, in judging order (what ``[checks.expected_failures]`` may name)."""
    return tuple(n for f in families() for n in f.checks)


def run_rules(s: Scenario, spec: RunSpec) -> list[tuple[CheckFamily, list[str]]]:
    """The families that apply to one run, in order, with the checks (plain names) each gives it.
    A run expected to fail gets the expected-failure check, one whose mutation kills a rank the
    mutation's, each with ``collective_agreement`` where it has more than one rank."""
    agreement = [(family("collectives"), [str(N.collective_agreement)])] if spec.world_size > 1 else []
    if spec.expect_error is not None:
        return [(family(N.expected_failure), [str(N.expected_failure)]), *agreement]
    if spec.fails_by_design:
        return [*agreement, (family("mutation"), [str(N.mutation_caught)])]
    return [(f, [str(n) for n in names]) for f in families()
            if f.name != N.expected_failure and (names := f.applies(s, spec))]
