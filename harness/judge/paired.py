"""A sequential paired test of speed: the candidate's runs against the baseline's, interleaved,
with pairs added until the verdict is decided.

On a noisy machine one median against a stored baseline cannot tell a 10 % slowdown from the
machine's mood. Runs of the baseline and the candidate taken in turns see the same machine; each
pair gives one log ratio of their speeds, and the pairs are tested together. The order within a
pair alternates, and the test looks only after an even number of pairs from ``min_pairs`` on
(and at ``max_pairs``), where both orders have run equally often, so an effect of going first
or second cancels in the estimate. At each look every run gated is tested two ways (Student's t
from ``scipy.stats``):

- **alarm** when "the candidate is at most ``margin`` slower" is rejected;
- **pass** when "the candidate is ``detect`` or more slower" is rejected.

Each test is made at a constant nominal level over the looks (Pocock's boundary: the level at
which the chance of crossing at any of the looks is ``alpha / runs`` for an alarm, ``beta`` for a
pass, under normal pair ratios; the multivariate normal from ``scipy.stats``). So a build within
``margin`` raises a false alarm in at most ``alpha`` of gates, and a run ``detect`` slower passes
in at most ``beta`` of them. A run still undecided at ``max_pairs`` is **inconclusive**: neither
hypothesis was rejected, so it neither passes nor fails, and its verdict gives the interval (more
pairs would decide it). Simulated with 10 pairs at most (``tests/test_paired_gate.py``), the
rates hold for pair ratios as noisy as 8 %, and at 6 % or less at most 3 % of runs end
inconclusive; at 8 % about a fifth of 10 %-slower runs do, and noisier pairs run out more often
(on 2 shared cores a 1-rank run's pairs vary 4.0 to 6.4 %, a 2-rank run's 6.3 to 12.5 %, hour to
hour: docs/benchmarks.md). The default ``alpha`` of 0.02 is well below the one
false alarm in 20 gates a team can live with, since an unchanged build sits exactly on the alarm
hypothesis's boundary (with ``margin`` 0) and so alarms at the full rate. The
verdict states the pairs taken, the estimate with its interval, and the smallest slowdown the
pairs taken could have detected with ``1 - beta`` power.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from functools import cache


@cache
def pocock_level(total: float, looks: tuple[int, ...]) -> float:
    """The one-sided nominal level that, used at every look (after ``looks[i]`` pairs), is crossed
    at some look with probability ``total`` by a normal statistic with independent increments."""
    if len(looks) == 1:
        return total
    import numpy as np
    from scipy.optimize import brentq
    from scipy.stats import multivariate_normal, norm

    n = np.asarray(looks, dtype=float)
    cov = np.sqrt(np.minimum.outer(n, n) / np.maximum.outer(n, n))
    mvn = multivariate_normal(mean=np.zeros(len(n)), cov=cov, allow_singular=True, seed=0,
                              maxpts=4000 * len(n), abseps=1e-5, releps=1e-4)

    def excess(c: float) -> float:
        return (1.0 - float(mvn.cdf(np.full(len(n), c)))) - total

    return float(norm.sf(brentq(excess, norm.isf(total), norm.isf(total / len(n)) + 0.5, xtol=1e-4)))


@dataclass(frozen=True)
class SequentialDesign:
    """What a sequential gate decides and at which error rates (module docstring)."""

    margin: float = 0.0
    detect: float = 0.10
    alpha: float = 0.02
    beta: float = 0.10
    min_pairs: int = 4
    max_pairs: int = 10
    runs: int = 1

    def __post_init__(self) -> None:
        if not 2 <= self.min_pairs <= self.max_pairs:
            raise ValueError(f"pairs: need 2 <= min_pairs ({self.min_pairs}) <= max_pairs ({self.max_pairs})")
        if not 0 <= self.margin < self.detect < 1:
            raise ValueError(f"need 0 <= margin ({self.margin:.0%}) < detect ({self.detect:.0%}) < 100%")

    @property
    def looks(self) -> tuple[int, ...]:
        """The pair counts it decides at: every second one from ``min_pairs``, and ``max_pairs``."""
        return tuple(sorted({*range(self.min_pairs, self.max_pairs + 1, 2), self.max_pairs}))

    @property
    def alarm_level(self) -> float:
        return pocock_level(self.alpha / max(1, self.runs), self.looks)

    @property
    def pass_level(self) -> float:
        return pocock_level(self.beta, self.looks)


@dataclass
class SequentialVerdict:
    """One run's comparison after ``pairs`` pairs: ``change`` is the candidate's speed relative to
    the baseline (-0.2: 20 % slower), with its interval; ``decided``: "alarm", "pass",
    "inconclusive" (out of pairs with neither rejected), or None (more pairs wanted);
    ``detectable``: the smallest slowdown these pairs could have caught."""

    pairs: int
    change: float
    low: float
    high: float
    p_alarm: float
    p_pass: float
    detectable: float
    decided: str | None
    design: SequentialDesign
    early: bool = False  # decided by crossing a boundary (every alarm and pass is)
    ratios: tuple[float, ...] = ()  # each pair's candidate speed over the baseline's, in order

    def pair_note(self, side_by_side: bool = False) -> str:
        """The pairs' changes, and how much faster a side ran second than first (pair k runs the
        baseline first when k is even, counting from 0), or, side by side, on the second half of
        the CPUs than on the first (the baseline has the first half when k is even)."""
        logs = [math.log(r) for r in self.ratios]
        second = (statistics.fmean(logs[0::2]) - statistics.fmean(logs[1::2])) / 2 if len(logs) >= 2 else 0.0
        if side_by_side:
            return (f"pairs {' '.join(f'{r - 1:+.1%}' for r in self.ratios)} (side by side, the baseline on the first "
                    f"half of the CPUs in the 1st, 3rd, ...); the second half changed a side's speed by "
                    f"{math.exp(second) - 1:+.1%}")
        return (f"pairs {' '.join(f'{r - 1:+.1%}' for r in self.ratios)} (the baseline first in the 1st, 3rd, ...); "
                f"running second changed a side's speed by {math.exp(second) - 1:+.1%}")

    @property
    def alarm(self) -> bool:
        return self.decided == "alarm"

    @property
    def inconclusive(self) -> bool:
        return self.decided == "inconclusive"

    def describe(self) -> str:
        d = self.design
        word = "slower" if self.change < 0 else "faster"
        how = (f"decided after {self.pairs} pairs" if self.early
               else f"inconclusive: not decided by {self.pairs} pairs, the most allowed (more pairs would decide)"
               if self.inconclusive else f"not decided after {self.pairs} pairs")
        high = f"{self.high:+.1%}" if self.high < 10 else "over +1000%"  # one degree of freedom: no bound to speak of
        return (f"{abs(self.change):.1%} {word} (interval {self.low:+.1%} to {high}); {how}: "
                f"p = {self.p_alarm:.2g} that it is at most {d.margin:.0%} slower (alarm below {d.alarm_level:.2g}), "
                f"p = {self.p_pass:.2g} that it is {d.detect:.0%} or more slower (pass below {d.pass_level:.2g}); "
                f"could have detected a {self.detectable:.1%} slowdown")


def sequential_look(base_speed: list[float], cand_speed: list[float], design: SequentialDesign) -> SequentialVerdict:
    """Test pair k's ``cand_speed[k] / base_speed[k]`` over the pairs so far (at least 2); a
    verdict is reached only at one of ``design.looks``."""
    from scipy.stats import t as student

    if len(base_speed) != len(cand_speed) or len(base_speed) < 2:
        raise ValueError("a paired speed test needs at least two pairs of runs")
    logs = [math.log(c / b) for b, c in zip(base_speed, cand_speed, strict=True)]
    n = len(logs)
    mean = statistics.fmean(logs)
    se = max(statistics.stdev(logs) / math.sqrt(n), 1e-12)
    df = n - 1
    at_margin, at_detect = math.log(1 - design.margin), math.log(1 - design.detect)
    p_alarm = float(student.cdf((mean - at_margin) / se, df))  # small: slower than the margin
    p_pass = float(student.sf((mean - at_detect) / se, df))  # small: faster than a `detect` slowdown
    alarm_q, pass_q = float(student.isf(design.alarm_level, df)), float(student.isf(design.pass_level, df))
    half = float(student.isf(design.alpha / max(1, design.runs) / 2, df)) * se
    detectable = 1 - math.exp(at_margin - (alarm_q + pass_q) * se)
    decided = None
    early = False
    if n in design.looks:
        if p_alarm < design.alarm_level:
            decided, early = "alarm", True
        elif p_pass < design.pass_level:
            decided, early = "pass", True
        elif n >= design.max_pairs:  # out of pairs with neither rejected: neither pass nor alarm
            decided = "inconclusive"
    # one degree of freedom (2 pairs) at a small alpha puts the interval's top past a float's range
    # (t = 637 at 0.001): pairs 3x apart overflow math.exp; infinite, it reads "over +1000%"
    high = math.exp(mean + half) - 1 if mean + half < 700 else math.inf
    return SequentialVerdict(n, math.exp(mean) - 1, math.exp(mean - half) - 1, high, p_alarm,
                             p_pass, max(0.0, detectable), decided, design, early,
                             tuple(c / b for b, c in zip(base_speed, cand_speed, strict=True)))
