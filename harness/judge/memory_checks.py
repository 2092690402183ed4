"""The memory checks, as ``harness.memory.judging`` measures them: ``memory_*`` (a run's peaks
against the scenario's ``[checks]`` ceilings) and ``wired_share`` (no rank holds more than its
share of its machine's memory)."""

from __future__ import annotations

from harness.controller.outcome import RunOutcome
from harness.judge.checks import Check, ranks
from harness.memory.judging import Measured, ceilings, within_share
from harness.scenario import Scenario
from harness.scenario.checks import MEMORY, CheckName


def _check(name: str, run: RunOutcome, m: Measured) -> Check:
    return Check(name, run.name, m.passed, m.value, m.limit, m.detail, applicable=m.applicable)


def memory_ceilings(run: RunOutcome, s: Scenario) -> list[Check]:
    """Peak RSS above each rank's baseline and peak MLX memory, per rank (the largest rank) and
    summed over ranks, each where the scenario sets its ceiling. Each rank reports its baseline
    (``harness.memory.sampler``): where MLX memory is host memory (CPU, Metal), what it held at
    job start (MLX's device runtime and the trainer's libraries); on CUDA its RSS at the end of
    its first step, after the runtime loaded that step's kernels (0.25 to 0.55 GB per rank on an
    H100). A rank that lacks a figure fails the check, naming it."""
    c = s.checks
    results = [(o.rank, o.result or {}) for o in run.ranks]
    out = []
    for label, names, limits in (("rss", MEMORY[:2], (c.max_rss_mb, c.max_total_rss_mb)),
                                 ("mlx", MEMORY[2:], (c.max_mlx_mb, c.max_total_mlx_mb))):
        measured = ceilings(results, label, *limits, ranks(run.world_size))
        out += [_check(name, run, m) for name, m in zip(names, measured, strict=True) if m is not None]
    return out


def wired_share(run: RunOutcome) -> Check:
    """The worst rank's MLX peak against its share (value and limit in MB)."""
    return _check(CheckName.wired_share, run, within_share([(o.rank, o.result or {}) for o in run.ranks]))
