"""Parity verdicts: step-local parity at identical parameters, and trajectories against a
measured noise floor.

**Step-local.** At a probe step the compared run's global loss, token count and gradient are
taken at the reference's parameters on the same global batch, so only rounding separates them.
Both runs sum T token terms in float32 accumulators (error at most about ceil(log2 T) units of
u_acc = 2^-24 for blocked or pairwise sums) and round stored partial sums (each micro-step's
accumulation, each of the ceil(log2 N) all-reduce levels) at u, the model dtype's unit roundoff
or the device matmul's, whichever is coarser (measured by each rank: TF32 makes float32 matmuls
round at 2^-11). The relative error of their difference is held to
``rounding_ulps`` x (u_acc x ceil(log2 T) + u x (grad_accum + ceil(log2 N))): 2 for the two runs
times 2 for sums whose terms partly cancel. The token count must be equal.

**Trajectory.** Over many steps AdamW turns rounding into moves of up to the learning rate
(the sign of a near-zero gradient element) and the differences compound, so no rounding bound
holds. Each comparison is instead judged against a floor run (``harness.scenario.runs``) that does the same
mathematics in another summation order: per step, value / max(floor, absolute floor) must
stay within ``floor_ratio``. The floor is the floor run's largest deviation over the same steps:
where in a run chaotic growth reaches a given size is itself random, so two runs of equal noise
are compared by their worst, not step by step (per-step precision is the step-local check's
job); an eval's floor also takes the floor run's training-loss deviations up to the last eval
step, a larger sample of the same drift than a few eval points. A split floor (an external
trainer's) is several runs, draws of the rounding; its floor is their largest deviation, point by
point (``Floor.largest``): one draw's size varies tenfold. The absolute floor is the
rounding of one value (a loss: its float32 accumulation over T tokens, ``rounding_ulps`` x
2^-24 x ceil(log2 T), relative; parameters: their storage in the model dtype,
``rounding_ulps`` x u_dtype), so a floor run that happens to match bitwise
does not demand bitwise equality. A resume at the same world
size is judged against a rerun of its target over the whole run: a rerun that is bitwise equal
on a CPU means the device is deterministic, and the resume must then be bitwise too (on a GPU a
bitwise rerun is a draw: ``deterministic``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.controller.outcome import RunOutcome
from harness.controller.params import param_delta
from harness.judge.checks import Check, computed_at, listed
from harness.judge.defects import name_defect
from harness.scenario.checks import STEP_LOCAL, CheckName
from harness.scenario.plan import ScenarioPlan

U_ACC = 2.0**-24  # float32 accumulators, on every MLX device


@dataclass
class Rounding:
    """The rounding model of a comparison: ``u`` per stored rounding (the coarser of the dtype's
    and the device matmul's unit roundoff), ``stored`` roundings, ``u_dtype`` the dtype's own."""

    ulps: float
    u: float
    stored: int
    u_dtype: float = U_ACC

    def relative(self, length: int) -> float:
        """The relative limit for a reduction over ``length`` terms."""
        return self.accumulation(length) + self.ulps * self.u * self.stored

    def accumulation(self, length: int) -> float:
        """Float32 accumulation over ``length`` terms alone (no operand or storage rounding)."""
        return self.ulps * U_ACC * math.ceil(math.log2(max(length, 2)))

    @property
    def storage(self) -> float:
        """Rounding each value once as the model dtype stores it (parameters), relative. The
        gradient's stored partial sums (``stored``) do not enter: they reach the parameters only
        through the optimizer, which the floor run measures."""
        return self.ulps * self.u_dtype

    def formula(self, length: int) -> str:
        return (f"{self.ulps:g} x (2^-24 x ceil(log2 {length}) + {self.u:.3g} x {self.stored}) "
                f"= {self.relative(length):.3g} relative")


def rounding(plan: ScenarioPlan, *runs: RunOutcome, probes: bool = False) -> Rounding:
    """The rounding model of comparing ``runs`` (``probes``: their step-local probes): the
    coarsest unit roundoff any rank measured, and the most stored roundings (micro-steps plus
    all-reduce levels) of any of them."""
    u, u_dtype, stored = U_ACC, U_ACC, 1
    for run in runs:
        results = [o.result or {} for o in run.ranks]
        accum = plan.run(run.name).eff.train.grad_accum
        n = run.world_size * int(results[0].get("emulate") or 1)
        precs = [computed_at(r, probes) for r in results]
        u = max([u, *(float(p.get("u_in", U_ACC)) for p in precs)])
        u_dtype = max([u_dtype, *(float(p.get("u_dtype", U_ACC)) for p in precs)])
        stored = max(stored, accum + math.ceil(math.log2(n)))
    return Rounding(plan.scenario.checks.rounding_ulps, u, stored, u_dtype)


# -- step-local -----------------------------------------------------------------------------


def _probe_records(run: RunOutcome) -> list[list[dict[str, Any]]]:
    return [o.result["probes"] or [] if o.result else [] for o in run.ranks]




def step_local(run: RunOutcome, ref: RunOutcome, plan: ScenarioPlan, floor: RunOutcome | None = None) -> list[Check]:
    """Token count, global loss and gradient at the reference's parameters, at every probe step
    the reference recorded within the steps this run executed (none there: not applicable).

    The limit is the rounding limit, or ``floor_ratio`` times what ``floor`` (a noise-floor run
    probed at the same parameters: the same mathematics in the run's shapes and summation order)
    measured at the same steps where that is larger: a device whose matmuls round their operands
    (TF32) differs with the batch's shape by more than rounding in the sums alone explains."""
    per_rank = _probe_records(run)
    r0 = run.result()
    recorded = [p["step"] for p in ref.result()["probes"] or []]
    expected = [k for k in recorded if r0["steps_start"] <= k <= r0["steps"]]
    if not recorded:
        return [Check(n, run.name, False, None, None, f"{ref.name} recorded no probes; not measured")
                for n in STEP_LOCAL]
    if not expected:
        why = f"ran steps {r0['steps_start']}-{r0['steps']}; {ref.name} probed steps {listed(recorded)}"
        return [Check(n, run.name, True, None, None, f"{why}: nothing to measure", applicable=False)
                for n in STEP_LOCAL]
    got = [p["step"] for p in per_rank[0]]
    if got != expected:
        why = f"probed steps {listed(got)}, expected {listed(expected)}"
        return [Check(n, run.name, False, None, None, why) for n in STEP_LOCAL]
    model = rounding(plan, run, ref, probes=True)
    steps = [rec["step"] for rec in per_rank[0]]
    tokens = max(abs(rec["tokens"] - rec["tokens_ref"]) for recs in per_rank for rec in recs)
    token_check = Check(CheckName.step_token_parity, run.name, tokens == 0, tokens, 0,
                        f"global supervised tokens vs {ref.name} at steps {listed(steps)}",
                        derivation="exact: both runs must count the same supervised tokens")

    def measured(rec: dict[str, Any], key: str) -> float:
        return abs(rec["loss"] - rec["loss_ref"]) / abs(rec["loss_ref"]) if key == "loss" else rec["grad_rel"]

    floor_recs = [rec for recs in (_probe_records(floor) if floor is not None else []) for rec in recs
                  if rec.get("step") in steps]
    out = [token_check]
    limits: dict[str, Any] = {}
    for key, name in (("loss", CheckName.step_loss_parity), ("grad", CheckName.step_grad_parity)):
        noise = max((measured(rec, key) for rec in floor_recs), default=None)
        scaled = plan.scenario.checks.floor_ratio * noise if noise is not None else 0.0

        def limit_at(rec: dict[str, Any], scaled: float = scaled) -> float:
            return max(model.relative(rec["tokens_ref"]), scaled)

        limits[key] = limit_at

        value, limit, rec = max(((measured(rec, key), limit_at(rec), rec) for recs in per_rank for rec in recs),
                                key=lambda x: x[0] / x[1])
        what = "global loss" if key == "loss" else "all-reduced gradient ||g - g_ref|| / ||g_ref||"
        detail = f"relative error of the {what} at {ref.name}'s parameters; worst at step {rec['step']}"
        if key == "grad":
            detail += f"; worst tensor {rec['worst_tensor']} ({rec['worst_rel']:.3g})"
        derivation = (f"rounding {model.formula(rec['tokens_ref'])} (T = {rec['tokens_ref']} tokens, "
                      f"{model.stored} stored roundings, u = {model.u:.3g})")
        if noise is not None:
            ratio = plan.scenario.checks.floor_ratio
            derivation = (f"max({derivation}; {ratio:g} x {floor.name}'s largest error at the "
                          f"same parameters and steps ({noise:.3g}))")
        out.append(Check(name, run.name, value <= limit, value, limit, detail, derivation=derivation,
                         floor=noise))
    for c, key in zip(out[1:], ("loss", "grad"), strict=True):
        if not c.passed:  # which known defect the trainer's figure matches (harness.judge.defects)
            found = name_defect(per_rank, key, limits[key])
            c.detail += f"; {found.text}"
            c.defect = found.defect
    return out


# -- trajectories ----------------------------------------------------------------------------


def _losses(run: RunOutcome) -> list[float]:
    return list(run.result().get("losses", []))


def unrecorded(run: RunOutcome) -> int:
    """The steps before ``run``'s history starts: a run resumed by a trainer that restores no
    record of the steps trained before its checkpoint (0 for every other run)."""
    return int(run.result().get("history_start", 1)) - 1


def _evals(run: RunOutcome) -> dict[int, tuple[float, int]]:
    return {e["step"]: (e["loss"], e["tokens"]) for e in run.result().get("evals", [])}


def _param_delta(a: RunOutcome, b: RunOutcome) -> tuple[float, float, str] | None:
    """``param_delta`` of two runs' final parameters (rank 0's)."""
    return param_delta(a.params, b.params)


@dataclass
class Floor:
    """What a comparison is judged against: a floor run, or an absolute tolerance the scenario set."""

    run: RunOutcome | None = None
    tolerance: float | None = None
    tolerance_key: str = ""
    rerun: bool = False  # a rerun: a floor of 0 on a CPU means the device is deterministic (bitwise)
    refused: str | None = None  # why the floor run is not the base's mathematics
    samples: tuple[RunOutcome | None, ...] = ()  # a split floor's other draws of the rounding

    @property
    def runs(self) -> list[RunOutcome | None]:
        return [self.run, *self.samples]

    @property
    def names(self) -> str:
        """The floor runs, named for a derivation."""
        names = [r.name for r in self.runs if r is not None]
        return names[0] if len(names) == 1 else f"the largest of {', '.join(names)}"

    @property
    def missing(self) -> str | None:
        if self.tolerance is not None:
            return None
        if any(r is None for r in self.runs):
            return "no noise-floor run"
        failed = next((r.name for r in self.runs if r is not None and not r.ok), None)
        return self.refused or (f"noise-floor run {failed} failed" if failed else None)

    def largest(self, deviation: Callable[[RunOutcome], list[float] | None]) -> list[float] | None:
        """Point by point, the largest ``deviation`` of the floor's runs (None: a run lacks it)."""
        if any(r is None or not r.ok for r in self.runs):
            return None
        got = [deviation(r) for r in self.runs if r is not None]
        if any(g is None for g in got):
            return None
        return [max(points) for points in zip(*got, strict=False)]  # type: ignore[arg-type]


def deterministic(*runs: RunOutcome) -> bool:
    """Every rank of ``runs`` computed on a CPU, where a rerun repeats every reduction in the same
    order. A GPU's scatter-adds (the embedding's gradient) accumulate with atomics, in whichever
    order the threads arrive: a bitwise rerun there is a draw, not a property (on one H100, of
    three processes of one resumable run, two agreed bitwise and one differed by one ulp in the
    loss of step 6)."""
    return all(o.result.get("accelerator") == "cpu" for r in runs for o in r.ranks if o.result)


def _judge_series(name: str, run: RunOutcome, base: RunOutcome, points: list[Any], deltas: list[float],
                  floors: list[float] | None, absolute: list[float], floor: Floor, plan: ScenarioPlan, what: str,
                  deviation: str = "deviation") -> Check:
    """value / max(floor, absolute floor) <= floor_ratio at every point (or value <= tolerance)."""
    if floor.tolerance is not None:
        value = max(deltas, default=0.0)
        at = points[deltas.index(value)] if deltas else "-"
        return Check(name, run.name, value <= floor.tolerance, value, floor.tolerance,
                     f"vs {base.name}: {what}; worst at {at}",
                     derivation=f"absolute: [checks].{floor.tolerance_key} = {floor.tolerance:g} set by the scenario")
    if floor.missing or floors is None or len(floors) < len(deltas):
        why = floor.missing or f"{floor.names} has fewer points than {run.name}"
        return Check(name, run.name, False, max(deltas, default=None), None, f"vs {base.name}: {why}",
                     derivation="no valid noise floor: the trajectory cannot be judged")
    if not all(math.isfinite(f) for f in floors[: len(deltas)]):
        said = non_finite(tuple((r.name, _losses(r)) for r in floor.runs if r is not None)) or \
            f"{floor.names}'s deviation is not finite"
        said = said.removeprefix("not finite: ").split("; the training diverges")[0]
        why = f"the noise floor diverged where {run.name} did not ({said})"
        return Check(name, run.name, False, max(deltas, default=None), None, f"vs {base.name}: {why}",
                     derivation="no valid noise floor: the trajectory cannot be judged")
    ratio_limit = plan.scenario.checks.floor_ratio
    measured = max(floors[: len(deltas)], default=0.0)
    floors = [measured] * len(deltas)
    bitwise = floor.rerun and measured == 0 and deterministic(run, base)
    if bitwise:
        absolute = [0.0] * len(deltas)  # a bitwise rerun on a deterministic device
    eff = [max(f, a) for f, a in zip(floors, absolute, strict=False)]
    ratios = [d / e if e > 0 else (0.0 if d == 0 else math.inf) for d, e in zip(deltas, eff, strict=False)]
    i = max(range(len(ratios)), key=lambda k: ratios[k]) if ratios else 0
    value = deltas[i] if deltas else 0.0
    limit = ratio_limit * eff[i] if eff else 0.0
    detail = f"vs {base.name}: {what}; worst ratio at {points[i] if points else '-'}"
    if bitwise:
        derivation = (f"{floor.run.name} repeated {base.name} bitwise on a CPU, whose reductions are "
                      f"deterministic, so the limit is 0 (bitwise)")
    else:
        derivation = (f"{ratio_limit:g} x max(floor, absolute floor); floor: {floor.names}'s largest {deviation} "
                      f"from {base.name} over the same steps ({measured:.3g}); absolute floor: the rounding of "
                      f"one value there ({absolute[i]:.3g})")
    passed = value <= limit if limit > 0 else value == 0
    return Check(name, run.name, passed, value, limit, detail, floor=eff[i] if eff else None, derivation=derivation,
                 noise=measured)


def non_finite(series: tuple[tuple[str, list[float]], ...], skip: int = 0) -> str | None:
    """Which runs' losses are not finite, from which step (None: every one is finite): a training
    that diverged has no deviation to judge."""
    firsts = [(who, skip + k + 1, x) for who, xs in series
              for k, x in [next(((k, x) for k, x in enumerate(xs) if not math.isfinite(x)), (None, None))]
              if k is not None]
    if not firsts:
        return None
    said = "; ".join(f"{who}'s loss is {x} from step {step}" for who, step, x in firsts)
    both = len(firsts) == len(series)
    return f"not finite: {said}" + ("; the training diverges in one process too" if both else "")


def loss_parity(run: RunOutcome, base: RunOutcome, floor: Floor, plan: ScenarioPlan, name: str = CheckName.loss_parity,
                prefix: bool = False) -> Check:
    """Per-step global loss vs ``base`` (over ``run``'s steps when it stopped early by design, and
    from the step its history starts when it resumed without a record of the steps before)."""
    skip = unrecorded(run)
    a, b = _losses(run), _losses(base)[skip:]
    if prefix:
        b = b[: len(a)]
    if len(a) != len(b):
        return Check(name, run.name, False, None, None, f"vs {base.name}: {len(a)} vs {len(b)} steps")
    diverged = non_finite(((run.name, a), (base.name, b)), skip)
    if diverged:
        return Check(name, run.name, False, None, None, f"vs {base.name}: {diverged}")
    deltas = [abs(x - y) for x, y in zip(a, b, strict=True)]
    floors = floor.largest(lambda r: [abs(x - y) for x, y in zip(_losses(r)[skip:], b, strict=False)])
    model = rounding(plan, run, base)
    tokens = (base.result().get("tokens_global_per_step") or [])[skip:]
    absolute = [model.accumulation(tokens[k] if k < len(tokens) else 2) * abs(y) for k, y in enumerate(b)]
    what = f"{len(a)} steps" if not skip else f"steps {skip + 1}-{skip + len(a)} (no record of steps 1-{skip})"
    what += "; bitwise identical" if max(deltas, default=0.0) == 0 else ""
    return _judge_series(name, run, base, [f"step {skip + k + 1}" for k in range(len(a))], deltas, floors, absolute,
                         floor, plan, what)


def eval_parity(run: RunOutcome, base: RunOutcome, floor: Floor, plan: ScenarioPlan,
                name: str = CheckName.eval_parity) -> Check:
    """Eval losses at the same steps vs ``base``.

    The floor is the floor run's largest loss deviation, eval or training, up to the last eval
    step: both are losses of the same drifted parameters, and a handful of eval points alone is
    too small a sample of that drift (the ratio of two single deviations of equal noise is
    heavy-tailed)."""
    a, b = _evals(run), _evals(base)
    elsewhere = ""
    if unrecorded(run) and a.keys() != b.keys():  # a resumed trainer's own eval cadence: compare where both evaluated
        common = {k for k in a.keys() & b.keys() if k >= unrecorded(run)}
        elsewhere = f"; evaluated only by {run.name}: {listed(sorted(a.keys() - common))}" if a.keys() - common else ""
        a, b = {k: a[k] for k in common}, {k: b[k] for k in common}
    if not a or a.keys() != b.keys():
        why = f"eval steps {listed(sorted(a))} vs {listed(sorted(b))}{elsewhere}"
        return Check(name, run.name, False, None, None, why)
    steps = sorted(a)
    deltas = [abs(a[k][0] - b[k][0]) for k in steps]

    def worst(r: RunOutcome) -> list[float] | None:
        f = _evals(r)
        if not f or not all(k in f for k in steps):
            return None
        trained = [abs(x - y) for x, y in zip(_losses(r), _losses(base), strict=False)][: steps[-1]]
        return [max([abs(f[k][0] - b[k][0]) for k in steps] + trained)] * len(steps)

    floors = floor.largest(worst)
    model = rounding(plan, run, base)
    absolute = [model.accumulation(b[k][1]) * abs(b[k][0]) for k in steps]
    return _judge_series(name, run, base, [f"step {k}" for k in steps], deltas, floors, absolute, floor, plan,
                         f"at steps {listed(steps)}{elsewhere}", deviation="loss deviation (eval or training)")


def param_parity(run: RunOutcome, base: RunOutcome, floor: Floor, plan: ScenarioPlan,
                 name: str = CheckName.param_parity) -> Check:
    """Final parameters (rank 0) vs ``base``: ||delta|| / ||base's parameters||, over every element
    (the largest single element is named; as an extreme value of a few sign flips it is too erratic
    to judge by)."""
    got = _param_delta(run, base)
    if got is None:
        return Check(name, run.name, False, None, None, f"vs {base.name}: final parameters missing or differ in shape")
    value, biggest, where = got
    if math.isnan(value):
        return Check(name, run.name, False, None, None, f"vs {base.name}: not finite: {where} holds values that "
                                                        f"are not ({run.name}'s or {base.name}'s final parameters)")
    floors = floor.largest(lambda r: [d[0]] if (d := _param_delta(r, base)) is not None else None)
    model = rounding(plan, run, base)
    stored = [u for u in (run.params_u, base.params_u) if u is not None]
    absolute = [model.ulps * max(stored) if stored else model.storage]  # as the compared parameters are stored
    what = "bitwise identical" if value == 0 else f"relative L2; largest element |delta| {biggest:.3g} in {where}"
    return _judge_series(name, run, base, ["the end"], [value], floors, absolute, floor, plan, what)
