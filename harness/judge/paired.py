"""A paired test of speed: the candidate's runs against the baseline revision's, interleaved.

On a noisy machine one median against a stored baseline cannot tell a 20 % slowdown from the
machine's mood: the allowance must cover run-to-run spread, and the spread of a tiny model on
two shared cores is tens of percent. Runs of the baseline and the candidate taken in turns, in
the same job, see the same machine; each pair gives one log ratio of their tok/s (the median
over each run's steps after the first, many samples per run), and the pairs' ratios are tested
together. A run alarms when the one-sided Student t test rejects "the candidate is at most
``margin`` slower" at level ``alpha / m`` (Bonferroni over the ``m`` runs gated at once, so the
whole gate raises a false alarm at most ``alpha`` of the time on an unchanged build; Student's
t from ``scipy.stats``). The result says how confident it is: the estimated change, its two-sided ``1 - alpha`` interval
and the p-value.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass
class PairedVerdict:
    """One run's paired comparison: ``change`` is the candidate's speed relative to the baseline
    (-0.2: 20 % slower), with its interval; ``alarm`` when it is slower beyond ``margin`` with
    the confidence the test demands."""

    pairs: int
    change: float
    low: float
    high: float
    p_value: float
    level: float
    margin: float
    alarm: bool

    def describe(self) -> str:
        word = "slower" if self.change < 0 else "faster"
        conf = 1 - self.level
        return (f"{abs(self.change):.1%} {word} (interval {self.low:+.1%} to {self.high:+.1%}); "
                f"p = {self.p_value:.2g} that it is at most {self.margin:.0%} slower, alarm below {self.level:.2g} "
                f"({conf:.1%} confidence), {self.pairs} interleaved pairs")


def paired_speed(base_tok_s: list[float], cand_tok_s: list[float], margin: float = 0.05, alpha: float = 0.05,
                 runs_gated: int = 1) -> PairedVerdict:
    """Test pair k's ``cand_tok_s[k] / base_tok_s[k]`` over all pairs (at least 2)."""
    if len(base_tok_s) != len(cand_tok_s) or len(base_tok_s) < 2:
        raise ValueError("a paired speed test needs at least two pairs of runs")
    logs = [math.log(c / b) for b, c in zip(base_tok_s, cand_tok_s, strict=True)]
    n = len(logs)
    mean = statistics.fmean(logs)
    se = statistics.stdev(logs) / math.sqrt(n)
    level = alpha / max(1, runs_gated)
    bound = math.log(1.0 - margin)  # "at most margin slower": log ratio >= bound
    if se == 0:
        p = 0.0 if mean < bound else 1.0
        half = 0.0
    else:
        from scipy.stats import t as student

        p = float(student.cdf((mean - bound) / se, n - 1))  # small when the mean is far below the bound
        half = float(student.ppf(1 - level / 2, n - 1)) * se
    return PairedVerdict(n, math.exp(mean) - 1, math.exp(mean - half) - 1, math.exp(mean + half) - 1, p, level,
                         margin, p < level)
