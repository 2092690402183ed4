"""Rates of rare events with exact intervals: the soak's hangs per 1,000 calls.

``clopper_pearson`` is the exact (Clopper-Pearson) interval of a binomial proportion, found by
bisection on the binomial distribution function (no SciPy): the upper end is the p at which
seeing ``k`` or fewer events has probability alpha / 2, the lower end the p at which seeing
``k`` or more does. It covers the true rate at least 1 - alpha of the time, and with no event
still gives an upper bound (``1 - (alpha / 2) ** (1 / n)``: 0.369 per 1,000 in 10,000 calls).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

PER = 1000  # rates are given per this many calls


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed over the shorter tail in log space."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq, top = math.log(p), math.log1p(-p), math.lgamma(n + 1)

    def pmf(i: int) -> float:
        return math.exp(top - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)

    if k <= n // 2:
        return min(1.0, math.fsum(pmf(i) for i in range(k + 1)))
    return max(0.0, 1.0 - math.fsum(pmf(i) for i in range(k + 1, n + 1)))


def _solve(f: Callable[[float], float], target: float) -> float:
    """The p in [0, 1] where the decreasing function ``f`` crosses ``target`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if f(mid) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-15:
            break
    return (lo + hi) / 2


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The exact two-sided interval of the proportion behind ``k`` events in ``n`` trials."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= k <= n:
        raise ValueError(f"{k} events in {n} trials")
    tail = (1 - confidence) / 2
    lower = 0.0 if k == 0 else tail ** (1 / n) if k == n else _solve(lambda p: binom_cdf(k - 1, n, p), 1 - tail)
    upper = 1.0 if k == n else 1 - tail ** (1 / n) if k == 0 else _solve(lambda p: binom_cdf(k, n, p), tail)
    return lower, upper


@dataclass(frozen=True)
class Rate:
    """``events`` in ``trials``, per ``PER`` trials, with its exact interval."""

    events: int
    trials: int
    confidence: float = 0.95

    @property
    def per(self) -> float | None:
        return None if self.trials == 0 else PER * self.events / self.trials

    @property
    def interval(self) -> tuple[float, float]:
        lo, hi = clopper_pearson(self.events, self.trials, self.confidence)
        return PER * lo, PER * hi

    def text(self) -> str:
        """``1.23 [0.45, 2.67]``; with no event, ``0 [0, 0.369]`` (the upper bound)."""
        if self.trials == 0:
            return "-"
        lo, hi = self.interval
        return f"{_g(self.per or 0.0)} [{_g(lo)}, {_g(hi)}]"

    def to_json(self) -> dict[str, float | int | None]:
        lo, hi = self.interval
        return {"events": self.events, "trials": self.trials, "per": PER, "rate": self.per,
                "confidence": self.confidence, "low": lo, "high": hi}


def _g(x: float) -> str:
    """Three significant figures, without an exponent down to 1e-4."""
    return "0" if x == 0 else f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (linear between order statistics); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    at = q * (len(xs) - 1)
    i = int(math.floor(at))
    j = min(i + 1, len(xs) - 1)
    return xs[i] + (xs[j] - xs[i]) * (at - i)
