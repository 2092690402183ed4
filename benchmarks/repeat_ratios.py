"""Per-repeat speed ratios a reader can trust: their mean with its 95 % confidence interval
(Student's t over the repeats), and on which side of a cost of ``EFFECT`` (2 %) it lies.

A benchmark that alternates two sides (bare and under the harness, say) gets one ratio per
repeat. The interval *resolves* the question "does it cost more than 2 %?" when it does not hold
1 - ``EFFECT`` (0.98): then either the cost is at most 2 % (the interval lies above 0.98; it may
hold 1) or it is more (it lies below 0.98). An interval that holds 0.98 is too wide: it cannot
tell a 2 % effect from none where it also holds 1, and where it lies below 1 it shows a cost but
not whether that cost is within 2 %. Until it resolves, the benchmark adds alternating repeats,
up to its stated limit (``Ratios.resolved``). It looks only after whole rotations of its sides
(``looks``), and each look's interval is at ``1 - 0.05 / looks`` (Bonferroni), so that the
intervals hold together at 95 % over the run, whatever look it stops at. An unresolved verdict
says about how many repeats would resolve it, were the mean and the spread to stay as they are
(``Ratios.repeats_to_resolve``): what a next sitting would take."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

EFFECT = 0.02
LEVEL = 0.95
RESOLVED = f"the interval does not hold {1 - EFFECT:g}, the line of a {EFFECT:.0%} cost"  # for a report's legend


def t_quantile(p: float, df: int) -> float:
    from scipy.stats import t

    return float(t.ppf(p, df))


def looks(first: int, most: int, unit: int, every: int | None = None) -> list[int]:
    """The repeats after which the intervals are looked at: ``first`` to ``most``, each rounded up
    to whole rotations of ``unit`` sides (every side first equally often), one rotation apart, or
    ``every`` repeats apart (rounded up the same way; the last look at ``most``). Fewer looks let
    each look's interval be narrower (``look_level``): a comparison that needs many repeats
    resolves in fewer of them when it is not looked at after each."""
    def whole(n: int) -> int:
        return -(-max(n, 1) // unit) * unit

    last = whole(max(first, most))
    points = list(range(whole(first), last + 1, whole(every) if every else unit))
    return points if points[-1] == last else [*points, last]


def look_level(n_looks: int) -> float:
    """Each look's confidence level, so that the run's is ``LEVEL`` over ``n_looks`` looks."""
    return 1 - (1 - LEVEL) / max(1, n_looks)


def ended(done: int, points: list[int], resolved: Callable[[], bool]) -> bool:
    """Whether ``done`` repeats end a run looked at after ``points``: at the last look, or at a
    look where ``resolved()`` (asked only there)."""
    return done >= points[-1] or (done in points and resolved())


@dataclass(frozen=True)
class Spread:
    """The repeats' spread of one ratio taken apart (``split_spread``)."""

    whole: float  # the standard deviation of the repeats' ratios
    within: float  # of it, the noise within a run
    between: float  # and the runs' own
    doubled: float  # what twice the steps a repeat would leave, the runs' own kept
    n: int

    def line(self) -> str:
        return (f"spread {self.whole:.4f}, of it within a run {self.within:.4f} and between runs {self.between:.4f}; "
                f"with twice the steps, about {self.doubled:.4f} ({self.n} repeats' halves)")


def split_spread(first: list[float], second: list[float]) -> Spread:
    """How much of the repeats' spread is noise within a run, from each repeat's ratio in the two
    halves of its window (``first``, ``second``): were the halves' noise independent, a whole
    window's share of it has the standard deviation of their difference over 2; the rest of the
    spread between repeats is the runs' own (process, placement, the machine's drift). What
    lengthening the window would buy: the spread with twice the steps, the rest kept."""
    whole = [(a + b) / 2 for a, b in zip(first, second, strict=True)]
    spread = statistics.stdev(whole)  # an estimate of the part at most the whole (both are estimates)
    within = min(statistics.stdev([a - b for a, b in zip(first, second, strict=True)]) / 2, spread)
    between = math.sqrt(spread**2 - within**2)
    return Spread(spread, within, between, math.sqrt(between**2 + within**2 / 2), len(whole))


def repeats_needed(mean: float, spread: float, level: float, effect: float = EFFECT, start: int = 2,
                   most: int = 100_000) -> int | None:
    """The fewest repeats (``start`` or more) whose interval at ``level``, were the mean and the
    spread as given, would resolve: its half-width under the mean's distance from ``1 - effect``.
    None past ``most``."""
    room = abs(mean - (1 - effect))

    def enough(k: int) -> bool:  # the half-width falls as k grows
        return t_quantile(0.5 + level / 2, k - 1) * spread / math.sqrt(k) < room

    lo, hi = start - 1, max(start, 2)  # not enough at lo (or lo is below start), enough at hi: bisect
    while not enough(hi):
        if hi >= most:
            return None
        lo, hi = hi, min(2 * hi, most)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def new_record(mean: float, spread: float, first: int, unit: int) -> tuple[int, int] | None:
    """A new record's plan that would resolve a ratio of this mean and spread: (its
    ``--max-repeats``, the look it would stop at), looking every ``first`` repeats from ``first``
    (``--look-every``), each look at the level its own number of looks sets. None past 100,000."""
    most = first
    while most <= 100_000:
        points = looks(first, most, unit, first)
        need = repeats_needed(mean, spread, look_level(len(points)))
        if need is None:
            return None
        stop = next((p for p in points if p >= need), None)
        if stop is not None:
            return points[-1], stop
        most = -(-max(need, most + first) // first) * first  # one more look or more: a little stricter at each
    return None


def cheapest_record(mean: float, spread: float, first: int, unit: int) -> tuple[int, int, int] | None:
    """Of new records looking every ``first``, half or a quarter as many repeats (at least 4, rounded
    up to whole rotations of ``unit`` sides), the one that would stop soonest at this mean and spread
    (``new_record``; fewer looks where two stop alike): (its ``--look-every``, its
    ``--max-repeats``, the look it would stop at). None past 100,000."""
    plans = []
    for every in sorted({-(-max(4, first // k) // unit) * unit for k in (1, 2, 4)}, reverse=True):
        at = new_record(mean, spread, every, unit)
        if at is not None:
            plans.append((at[1], len(looks(every, at[0], unit, every)), every, at[0]))
    if not plans:
        return None
    stop, _, every, most = min(plans)
    return every, most, stop


def what_it_takes(r: Ratios, points: list[int], unit: int, seconds: float | None, spread: Spread | None = None,
                  window_s: float | None = None) -> str | None:
    """For an unresolved ratio, what resolving it would take at this mean and spread: the look
    of this record (looked at after ``points``, ``unit`` sides a rotation) it would stop at, or
    past its last look, a new record's plan (``cheapest_record``); the minutes at ``seconds`` a repeat
    where known. With the spread taken apart and the window's seconds, a new record's with twice
    the steps in the window (the steps are part of a plan), the ratios' spread shrunk in the share
    ``spread`` gives for it."""
    if r.resolved() or len(r.values) < 2:
        return None

    def minutes(k: int, each: float | None) -> str:
        if not each:
            return ""
        span = f"about {k * each / 60:.0f} min" if k * each >= 60 else "under a minute"
        return f", {span} at {each:.1f} s a repeat"

    def plan(at: tuple[int, int, int] | None, each: float | None) -> str:
        if at is None:
            return "more than 100,000 repeats"
        every, most, stop = at
        return (f"a new record with --repeats {every} --max-repeats {most} --look-every {every}: about "
                f"{stop} repeats{minutes(stop, each)}")

    sd, done, need = statistics.stdev(r.values), len(r.values), r.repeats_to_resolve()
    stop = next((p for p in points if need is not None and p >= need), None)
    text = (f"about {stop} repeats, at that look ({stop - done} more{minutes(stop - done, seconds)})" if stop else
            f"past this record's {points[-1]}, {plan(cheapest_record(r.mean, sd, points[0], unit), seconds)}")
    if spread is not None and spread.whole > 0 and window_s and seconds:
        doubled = cheapest_record(r.mean, sd * spread.doubled / spread.whole, points[0], unit)
        text += f"; with twice the steps in the window, {plan(doubled, seconds + window_s)}"
    return text


@dataclass(frozen=True)
class Ratios:
    """One comparison's per-repeat ratios (numerator side over denominator side), judged at ``level``."""

    values: tuple[float, ...]
    level: float = LEVEL

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    def interval(self) -> tuple[float, float]:
        """The ``level`` confidence interval of the mean ratio (nan, nan under 2 repeats)."""
        n = len(self.values)
        if n < 2:
            return math.nan, math.nan
        half = t_quantile(0.5 + self.level / 2, n - 1) * statistics.stdev(self.values) / math.sqrt(n)
        return self.mean - half, self.mean + half

    def resolved(self, effect: float = EFFECT) -> bool:
        """Whether the interval lies wholly on one side of a cost of ``effect`` (module docstring)."""
        lo, hi = self.interval()
        return not math.isnan(lo) and not (lo < 1 - effect <= hi)

    def verdict(self, effect: float = EFFECT) -> str:
        lo, hi = self.interval()
        if math.isnan(lo):
            return "one repeat: no interval"
        if not self.resolved(effect):
            need = self.repeats_to_resolve(effect)
            wide = (f"too wide to tell a {effect:.0%} effect from none" if hi > 1 else
                    f"a cost of {1 - hi:.1%} to {1 - lo:.1%}, not yet told from {effect:.0%}")
            return wide + (f" (at this mean and spread, about {need} repeats would)" if need else "")
        if lo >= 1 - effect:
            return f"at most a {effect:.0%} cost" if lo < 1 else "no cost"
        return f"a cost of more than {effect:.0%} ({1 - hi:.1%} or more)"

    def repeats_to_resolve(self, effect: float = EFFECT, most: int = 100_000) -> int | None:
        """The fewest repeats whose interval, at this level and were the mean and the spread to stay
        as they are, would resolve (``repeats_needed``). None under 2 repeats, or past ``most``."""
        if len(self.values) < 2:
            return None
        return repeats_needed(self.mean, statistics.stdev(self.values), self.level, effect, len(self.values), most)

    def cell(self) -> str:
        lo, hi = self.interval()
        if math.isnan(lo):
            return f"{self.mean:.3f} (1 repeat)"
        return f"{self.mean:.3f} [{lo:.3f}, {hi:.3f}]"
