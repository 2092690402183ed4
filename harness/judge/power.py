"""Whether a parity comparison could see a defect at all.

A trajectory is judged against a floor run, the same mathematics in another summation order. That
holds only when every run of the comparison starts from the same parameters: runs that draw
their own weights (a script that never seeds its model) differ from the start by as much as any
defect would, their floor grows just as large, and every limit derived from it passes anything.
So a comparison first checks the start (``start_parity``: the replica digest before the first
step of the reference, of every rank of the compared run and of its floor runs), and then each
trajectory check's power: a check has power where its limit is at most half of what training
itself moved (``POWER_FRACTION``; the loss over the steps compared; the parameters,
``||final - start|| / ||final||`` as rank 0 measured it). One without power, whether its limit comes
from floor runs that drifted that far or from the absolute floor (the rounding of one value in the
dtype), is never a pass: where every run was shown to start from the reference's parameters it is
INCONCLUSIVE (``Check.inconclusive``), saying why and what would give it power; where the starts
differ or could not be compared it fails, "no power". Neither shows an expected failure's behaviour
(``harness.judge.behaviours`` leaves such a check alone) nor catches a planted defect.
"""

from __future__ import annotations

from collections.abc import Iterable

from harness.controller.outcome import RunOutcome
from harness.dtypes import UNIT_ROUNDOFF
from harness.judge.checks import Check, computed_at, precision_label
from harness.scenario.checks import CheckName
from harness.scenario.names import DEFECTS_DESCRIBED

NO_POWER = "no power"
TRAJECTORIES = (CheckName.loss_parity, CheckName.param_parity, CheckName.eval_parity)
SEED_IT = ("runs start from different weights: seed the model (the same seed on every rank and in every run, "
           "e.g. mx.random.seed(run.seed) before building it, or build it with run.model())")


def start_of(run: RunOutcome, rank: int = 0) -> tuple[int, str | None]:
    """The step a rank's run trained from and its replica digest there (None: not reported)."""
    r = run.ranks[rank].result or {}
    start = int(r.get("steps_start") or 1) - 1
    return start, (r.get("digests") or {}).get(str(start))


def start_parity(run: RunOutcome, ref: RunOutcome, floors: Iterable[RunOutcome | None]) -> Check:
    """Every rank of ``run`` and every floor run start from ``ref``'s parameters (equal digests)."""
    step, want = start_of(ref)
    if want is None:
        return Check(CheckName.start_parity, run.name, True, None, None,
                     f"not applicable: {ref.name} reported no parameters before its first step", applicable=False)
    sides = [(f"{run.name} rank {o.rank}", run, o.rank) for o in run.ranks]
    sides += [(f.name, f, 0) for f in floors if f is not None and f.ok]
    seen = {who: start_of(r, rank) for who, r, rank in sides}
    unreported = [who for who, (_, digest) in seen.items() if digest is None]
    if unreported:
        return Check(CheckName.start_parity, run.name, True, None, None,
                     f"not applicable: {', '.join(unreported)} reported no parameters before its first step",
                     applicable=False)
    other_step = [who for who, (at, _) in seen.items() if at != step]
    if other_step:
        return Check(CheckName.start_parity, run.name, True, None, None,
                     f"not applicable: {', '.join(other_step)} started at another step than {ref.name}",
                     applicable=False)
    differ = [who for who, (_, digest) in seen.items() if digest != want]
    detail = (f"{SEED_IT}; differ from {ref.name}'s: {', '.join(differ)}" if differ else
              f"{len(seen)} starts ({', '.join(seen)}) equal to {ref.name}'s, bitwise")
    apart = len({seen[who][1] for who, r, _ in sides if r is run}) > 1  # the run's own ranks disagree
    if apart:
        detail += f"; matches: {DEFECTS_DESCRIBED['rank_seeds']} (the run's ranks start from different weights)"
    return Check(CheckName.start_parity, run.name, not differ, len(differ), 0, detail,
                 derivation="exact: the parameter digest before step 1 of every rank and floor run equals the "
                            "reference's", defect="rank_seeds" if apart else None)


def loss_signal(base: RunOutcome, steps: int) -> float | None:
    """How far ``base``'s loss moved in training over its first ``steps`` steps compared."""
    losses = list(base.result().get("losses") or [])[:steps]
    return max(abs(x - losses[0]) for x in losses) if losses else None


POWER_FRACTION = 0.5  # a trajectory check has power where its limit is at most this share of what training moved


LEVELLED = 1.25  # a loss that moved less than this times its first half's move over all its steps has levelled off


def wider(*runs: RunOutcome) -> str | None:
    """The precision that would round less than what the ranks of ``runs`` computed at
    (``computed_at``): float32 where any computed in a narrower dtype, float32 without TF32 where
    any had TF32 matmuls; None at plain float32 or where unknown."""
    seen = [computed_at(o.result or {}) for run in runs for o in run.ranks]
    if any(UNIT_ROUNDOFF.get(p.get("dtype"), 0.0) > UNIT_ROUNDOFF["float32"] for p in seen):
        return "float32"
    if any(p.get("tf32") for p in seen):
        return "float32 without TF32 matmuls (MLX_ENABLE_TF32=0)"
    return None


def remedy(losses: list[float], better: str | None) -> str:
    """What would give a check without power power, from how the reference's ``losses`` moved:
    where they levelled off in the second half of the steps, more steps would move them little
    further while rounding keeps growing, so they are not offered; ``better``, the precision that
    would round less (``wider``), where there is one."""
    half = len(losses) // 2
    early = max((abs(x - losses[0]) for x in losses[: half + 1]), default=0.0)
    whole = max((abs(x - losses[0]) for x in losses), default=0.0)
    if half >= 2 and early > 0 and whole < LEVELLED * early:
        what = (f"{better} would give it power" if better else
                "training that moves further than rounding grows would give it power (a trained model's weights, "
                "real data)")
        return (f"{what}; more steps would not: the loss levelled off (it moved {early:.3g} in the first {half} "
                f"steps and {whole:.3g} in all {len(losses)}) while rounding keeps growing")
    return f"more steps or a larger learning rate (training moving further){f', or {better},' if better else ''} " \
           "would give it power"


def _lacks_power(c: Check, base: str, signal: float, what: str, precision: str, hint: str) -> str:
    """Why ``c``, whose limit is more than ``POWER_FRACTION`` of ``signal``, cannot decide, and what would let
    it (``hint``: ``remedy``'s)."""
    from_noise = c.limit * c.noise / c.floor if c.floor and c.noise is not None else 0.0
    if from_noise > POWER_FRACTION * signal:
        cause = (f"the floor runs (the same mathematics in another rounding) drifted from {base} so far that the limit "
                 f"they make, {from_noise:.3g}, is more than half of what {what} ({signal:.3g})")
    else:
        cause = (f"its limit, {c.limit:.3g}, set by the absolute floor (the rounding of one value at {precision}), is "
                 f"more than half of what {what} ({signal:.3g})")
    return (f"{cause}: rounding at {precision} grew over these steps about as far as training moved, so a defect "
            f"of that size could not be told from it; {hint}")


def judge_power(checks: list[Check], run: RunOutcome, base: RunOutcome, start: Check) -> list[Check]:
    """The trajectory checks that passed without power (the module docstring): INCONCLUSIVE where
    ``start`` showed every run starting from ``base``'s parameters, a failure otherwise."""
    compared = len(run.result().get("losses") or [])
    loss, param, evals = TRAJECTORIES
    signals = {loss: (loss_signal(base, compared), f"{base.name}'s loss moved in training"),
               param: (base.moved, f"{base.name}'s training moved its parameters (relative L2)")}
    signals[evals] = (loss_signal(base, len(base.result().get("losses") or [])), signals[loss][1])
    if base.moved is None:  # where the start is unknown: a relative L2 of 1 admits parameters of zero
        signals[param] = (1.0, f"{base.name}'s own norm (relative L2 1: the limit admits zero parameters)")
    precision, hint = precision_label(run, base), remedy(list(base.result().get("losses") or []), wider(run, base))
    for c in checks:
        if c.name not in TRAJECTORIES or not c.passed:
            continue
        if start.applicable and not start.passed:
            c.passed, c.no_power, c.detail = False, True, f"{NO_POWER}: {SEED_IT}; {c.detail}"
            continue
        signal, what = signals[c.name]
        if c.floor is None:  # a tolerance the scenario sets ([checks] loss_tolerance...) is the scenario's say
            continue
        if not signal or not isinstance(c.limit, int | float) or c.limit <= POWER_FRACTION * signal:
            continue
        why = _lacks_power(c, base.name, signal, what, precision, hint)
        c.no_power = True
        if start.applicable:
            c.inconclusive, c.detail = True, f"{NO_POWER}: {why}; {c.detail}"
        else:
            c.passed = False
            c.detail = (f"{NO_POWER}: {why}; and {start.detail.removeprefix('not applicable: ')}, so the runs may not "
                        f"start alike either: a run that never trained could pass; {c.detail}")
    return checks
