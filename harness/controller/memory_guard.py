"""Hard memory limits, enforced while a run runs.

Memory ceilings (``[checks] max_rss_mb``, ``max_mlx_mb``) are judged after a run from its peaks;
a run that runs away in memory would take the machine down before any verdict (on a Mac's
unified memory, the whole machine). So the watchdog samples every rank's RSS at each poll (and
reads the MLX memory a rank reports with each step) and stops the run at once when a rank passes
its hard limit: by default the larger of ``[limits] hard_memory_factor`` times its ceiling and
the ceiling plus ``hard_memory_slack_mb`` (a hard limit is for runaways; a run a little over a
tight ceiling is the ceiling check's to fail), or an absolute ``hard_rss_mb`` / ``hard_mlx_mb``.
RSS counts from what the rank held before its job (its ``rss_runtime_bytes``), as the ceiling
does. Whatever the scenario says, the ranks together may not hold more than
``machine_memory_fraction`` of the machine's memory (on a cluster, of each host's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from harness.controller.progress import after_step

if TYPE_CHECKING:
    from harness.scenario_spec import CheckSpec, LimitSpec

MB = 1024 * 1024


@dataclass
class MemoryLimits:
    """Per-rank hard limits in MB (``None``: none) and where each comes from, for the message."""

    rss_mb: float | None = None
    mlx_mb: float | None = None
    rss_source: str = ""
    mlx_source: str = ""
    machine_fraction: float = 0.9

    @classmethod
    def from_scenario(cls, limits: LimitSpec, checks: CheckSpec) -> MemoryLimits:
        """From a scenario's ``[limits]`` and ``[checks]``."""
        factor, slack = limits.hard_memory_factor, limits.hard_memory_slack_mb
        out = cls(machine_fraction=limits.machine_memory_fraction)
        for label, hard, ceiling in (("rss", limits.hard_rss_mb, checks.max_rss_mb),
                                     ("mlx", limits.hard_mlx_mb, checks.max_mlx_mb)):
            if hard is not None:
                value, source = hard, f"[limits] hard_{label}_mb"
            elif ceiling is not None and factor * ceiling >= ceiling + slack:
                value, source = factor * ceiling, f"{factor:g} x the ceiling [checks] max_{label}_mb = {ceiling:g}"
            elif ceiling is not None:
                value, source = ceiling + slack, f"the ceiling [checks] max_{label}_mb = {ceiling:g} + {slack:g} MB"
            else:
                continue
            setattr(out, f"{label}_mb", value)
            setattr(out, f"{label}_source", source)
        return out


@dataclass
class RankMemory:
    """What the watchdog knows of one rank's memory: its process, its RSS before the job, the
    last step it finished and the MLX memory it reported then."""

    pid: int | None = None
    rss_runtime: int = 0
    step: int = 0
    mlx_bytes: int = 0
    started: bool = False  # its ``start`` event came: rss_runtime is known


def rss_of(pid: int) -> int | None:
    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def over_limit(ranks: dict[int, RankMemory], limits: MemoryLimits, total_mb: float | None = None,
               rss_by: Callable[[int, int], int | None] | None = None,
               machine: str = "the machine") -> str | None:
    """The first rank above a hard limit, as one line naming the rank, the step, the value and the
    limit; or the ranks together above the machine's share of ``total_mb`` (default: the
    machine's memory); else ``None``. ``rss_by(rank, pid)``: a rank's RSS where it is not a local
    process (a cluster host's agent reports it); ``machine``: what ``total_mb`` is the memory of."""
    total = 0
    for r, m in sorted(ranks.items()):
        rss = (rss_by(r, m.pid) if rss_by else rss_of(m.pid)) if m.pid else None
        if rss is None:
            continue
        total += rss
        above = (rss - m.rss_runtime) / MB
        who = f"rank {r} exceeded its hard memory limit {after_step(m.step)}"
        if limits.rss_mb is not None and m.started and above > limits.rss_mb:
            return (f"{who}: RSS {above:.0f} MB above its runtime's {m.rss_runtime / MB:.0f} MB, "
                    f"limit {limits.rss_mb:.0f} MB ({limits.rss_source})")
        if limits.mlx_mb is not None and m.mlx_bytes / MB > limits.mlx_mb:
            return (f"{who}: MLX peak memory {m.mlx_bytes / MB:.0f} MB, "
                    f"limit {limits.mlx_mb:.0f} MB ({limits.mlx_source})")
    share = (total_mb if total_mb is not None else psutil.virtual_memory().total / MB) * limits.machine_fraction
    if total / MB > share:
        return (f"the ranks together hold {total / MB:.0f} MB RSS, above {limits.machine_fraction:g} of "
                f"{machine}'s memory ({share:.0f} MB)")
    return None
