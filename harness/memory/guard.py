"""Hard memory limits, enforced while a run runs.

Memory ceilings (``[checks] max_rss_mb``, ``max_mlx_mb``) are judged after a run from its peaks;
a run that runs away in memory would take the machine down before any verdict (on a Mac's
unified memory, the whole machine). So the watchdog stops the run at once when a rank passes its
hard limit on either figure: by default the larger of ``[limits] hard_memory_factor`` times its
ceiling and the ceiling plus ``hard_memory_slack_mb`` (a hard limit is for runaways; a run a
little over a tight ceiling is the ceiling check's to fail), or an absolute ``hard_rss_mb`` /
``hard_mlx_mb``. MLX memory, the device figure on every device (on CUDA MLX's buffers are not in
RSS), comes from the rank's ``memory`` events, which its sampler writes during a step as the
figure rises (``harness.memory.sampler``), and from its ``step`` events. RSS is polled at each poll
(on a cluster host, by its agent) and read from the same events, and counts from the baseline
the rank reports, as the ceiling does: what it held at job start, or on CUDA its RSS at the end
of its first step (until then only the machine's share holds it). Whatever the scenario says,
the ranks together may not hold more than ``machine_memory_fraction`` of the machine's memory
(on a cluster, of each host's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import psutil

from harness.memory.plan import MB
from harness.schema import after_step


class HardLimits(Protocol):
    """What the hard limits are set from: a scenario's ``[limits]``."""

    hard_rss_mb: float | None
    hard_mlx_mb: float | None
    hard_memory_factor: float
    hard_memory_slack_mb: float
    machine_memory_fraction: float


class Ceilings(Protocol):
    """The per-rank ceilings a scenario's ``[checks]`` judges after a run."""

    max_rss_mb: float | None
    max_mlx_mb: float | None


@dataclass
class MemoryLimits:
    """Per-rank hard limits in MB (``None``: none) and where each comes from, for the message."""

    rss_mb: float | None = None
    mlx_mb: float | None = None
    rss_source: str = ""
    mlx_source: str = ""
    machine_fraction: float = 0.9

    @classmethod
    def from_scenario(cls, limits: HardLimits, checks: Ceilings) -> MemoryLimits:
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
    """What the watchdog knows of one rank's memory, from its events: its process, the last step
    it finished, its RSS baseline (``start`` event; on CUDA the ``step`` event that set it), the
    largest RSS and MLX figures it reported and how the MLX one was measured."""

    pid: int | None = None
    step: int = 0
    started: bool = False
    rss_baseline: str = ""  # "job start"; on CUDA "end of the first step", then "end of step N"
    rss_baseline_bytes: int | None = None  # None until a CUDA rank's first step ended
    rss_sampled: int = 0  # the largest RSS its sampler reported after its baseline
    mlx_bytes: int = 0
    mlx_how: str = ""
    problem: str | None = None  # its events lack a field the hard RSS limit needs

    def saw(self, rank: int, e: dict[str, Any]) -> None:
        """Take in one event of rank ``rank``."""
        kind = e.get("kind")
        if kind == "start":
            self.pid, self.started = int(e["pid"]), True
            self._baseline(rank, e, "start")
        elif kind == "step":
            self.step = int(e.get("step") or self.step)
            self._mlx(int(e.get("mlx_peak_bytes") or 0), "its peak, reported at the end of the step")
            if "rss_baseline" in e:
                self._baseline(rank, e, "step")
        elif kind == "memory":
            self._mlx(max(int(e.get("mlx_active_bytes") or 0), int(e.get("mlx_peak_bytes") or 0)),
                      "sampled during the step")
            if self.rss_baseline_bytes is not None:
                self.rss_sampled = max(self.rss_sampled, int(e.get("rss_bytes") or 0))

    def _mlx(self, value: int, how: str) -> None:
        if value > self.mlx_bytes:
            self.mlx_bytes, self.mlx_how = value, how

    def _baseline(self, rank: int, e: dict[str, Any], kind: str) -> None:
        missing = [k for k in ("rss_baseline", "rss_baseline_bytes") if k not in e]
        if missing:
            self.problem = f"rank {rank}'s {kind} event has no {' or '.join(missing)}: its RSS has no baseline"
            return
        self.rss_baseline = str(e["rss_baseline"])
        self.rss_baseline_bytes = None if e["rss_baseline_bytes"] is None else int(e["rss_baseline_bytes"])
        self.rss_sampled = 0


def rss_of(pid: int) -> int | None:
    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def over_limit(ranks: dict[int, RankMemory], limits: MemoryLimits, total_mb: float | None = None,
               rss_by: Callable[[int, int], int | None] | None = None,
               machine: str = "the machine") -> str | None:
    """The first rank above a hard limit, as one line naming the rank, the step, the figure, its
    value and the limit; or the ranks together above the machine's share of ``total_mb``
    (default: the machine's memory); else ``None``. A rank's RSS is the one polled now and the
    largest its sampler reported, above its baseline (none yet: only the machine's share holds
    it); its MLX figure the largest it reported. ``rss_by(rank, pid)``: a rank's RSS where it is
    not a local process (a cluster host's agent reports it); ``machine``: what ``total_mb`` is
    the memory of."""
    total = 0
    for r, m in sorted(ranks.items()):
        polled = (rss_by(r, m.pid) if rss_by else rss_of(m.pid)) if m.pid else None
        total += polled or 0
        who = f"rank {r} exceeded its hard memory limit {after_step(m.step)}"
        if limits.rss_mb is not None and m.problem:
            return m.problem
        if limits.rss_mb is not None and m.rss_baseline_bytes is not None:
            base = m.rss_baseline_bytes
            for rss, how in ((polled, ""), (m.rss_sampled, ", sampled during the step")):
                if rss and (rss - base) / MB > limits.rss_mb:
                    return (f"{who}: RSS {(rss - base) / MB:.0f} MB above its baseline ({m.rss_baseline}: "
                            f"{base / MB:.0f} MB){how}, limit {limits.rss_mb:.0f} MB ({limits.rss_source})")
        if limits.mlx_mb is not None and m.mlx_bytes / MB > limits.mlx_mb:
            return (f"{who}: MLX memory {m.mlx_bytes / MB:.0f} MB ({m.mlx_how}), "
                    f"limit {limits.mlx_mb:.0f} MB ({limits.mlx_source})")
    share = (total_mb if total_mb is not None else psutil.virtual_memory().total / MB) * limits.machine_fraction
    if total / MB > share:
        return (f"the ranks together hold {total / MB:.0f} MB RSS, above {limits.machine_fraction:g} of "
                f"{machine}'s memory ({share:.0f} MB)")
    return None
