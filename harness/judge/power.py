"""Whether a parity comparison could see a defect at all.

A trajectory is judged against a floor run, the same mathematics in another summation order. That
holds only when every run of the comparison starts from the same parameters: runs that draw
their own weights (a script that never seeds its model) differ from the start by as much as any
defect would, their floor grows just as large, and every limit derived from it passes anything.
So a comparison first checks the start (``start_parity``: the replica digest before the first
step of the reference, of every rank of the compared run and of its floor runs), and then each
trajectory check's power: floor runs that differ from the reference so much that the limit they
make (``floor_ratio`` x their largest deviation) is as large as what training itself moved (the
loss over the steps compared; the parameters, ``||final - start|| / ||final||`` as rank 0
measured it) would pass a run that never trained, and the check is reported as a failure, "no
power", never a pass (nor an expected failure's behaviour shown: ``harness.judge.behaviours``
leaves such a check failed). A limit that only the absolute floor (the rounding of one value in
the model's dtype) lifts that high is the dtype's, not noise: the check passes, saying what it
could not see.
"""

from __future__ import annotations

from collections.abc import Iterable

from harness.controller.outcome import RunOutcome
from harness.judge.checks import Check
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


def judge_power(checks: list[Check], run: RunOutcome, base: RunOutcome, start: Check) -> list[Check]:
    """The trajectory checks that passed without power turned into failures saying why: runs
    that start apart (``start``), or a limit as large as what ``base``'s training moved."""
    compared = len(run.result().get("losses") or [])
    loss, param, evals = TRAJECTORIES
    signals = {loss: (loss_signal(base, compared), f"{base.name}'s loss moved in training"),
               param: (base.moved, f"{base.name}'s training moved its parameters (relative L2)")}
    signals[evals] = (loss_signal(base, len(base.result().get("losses") or [])), signals[loss][1])
    if base.moved is None:  # where the start is unknown: a relative L2 of 1 admits parameters of zero
        signals[param] = (1.0, f"{base.name}'s own norm (relative L2 1: the limit admits zero parameters)")
    for c in checks:
        if c.name not in TRAJECTORIES or not c.passed:
            continue
        if start.applicable and not start.passed:
            c.passed, c.no_power, c.detail = False, True, f"{NO_POWER}: {SEED_IT}; {c.detail}"
            continue
        signal, what = signals[c.name]
        if c.floor is None or c.noise is None or not signal or not isinstance(c.limit, int | float):
            continue
        from_noise = c.limit * c.noise / c.floor if c.floor > 0 else 0.0  # floor_ratio x the floor runs' deviation
        if from_noise >= signal:
            c.passed, c.no_power = False, True
            c.detail = (f"{NO_POWER}: the floor runs differ from {base.name} so much that the limit they make, "
                        f"{from_noise:.3g}, is as large as {what} ({signal:.3g}): a run that never trained would "
                        f"pass; are the runs seeded alike and their data order fixed?; {c.detail}")
        elif c.limit >= signal:
            c.detail += (f"; its limit, set by the absolute floor (the rounding of one value), is as large as {what} "
                         f"({signal:.3g}): it could not see a defect smaller than that")
    return checks
