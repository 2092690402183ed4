"""What the machine's CPUs did while a run ran: how much of them the run itself used (the
controller, the launcher and the ranks) and how much other processes took.

Timings compared across runs are only as good as the machine was quiet: a run that shared its
cores with another job (a parallel test, a build) measures that job too. The judge reads
``CpuUse.disturbed`` before it compares two runs' speeds. On a GPU the contention that matters is
other launches on the same devices, which take few CPUs: ``speed_disturbed`` weighs both.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from harness.controller.rank_budget import Neighbours

SLACK_CORES = 0.25  # other processes' use a run tolerates beyond the cores it leaves free


def usable_cpus() -> list[int] | None:
    """The CPUs this process may run on, where the system says (Linux); None: all of them."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _busy_s(cpus: list[int] | None) -> tuple[float, int]:
    """CPU-seconds spent busy since boot on ``cpus`` (all when None), and how many CPUs."""
    per_cpu = psutil.cpu_times(percpu=True)
    picked = [per_cpu[i] for i in cpus if i < len(per_cpu)] if cpus else per_cpu
    busy = sum(t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
               + getattr(t, "steal", 0.0) for t in picked)
    return busy, len(picked)


def _own_s() -> float:
    """CPU-seconds of this process and of its children that have been waited for."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        use = resource.getrusage(who)
        total += use.ru_utime + use.ru_stime
    return total


@dataclass
class CpuUse:
    """CPU time on this machine's CPUs during one run, in seconds."""

    cores: int
    wall_s: float
    busy_s: float  # every process on those CPUs
    own_s: float  # the controller, the launcher and the ranks

    @property
    def others_cores(self) -> float:
        """How many cores other processes kept busy on average."""
        return max(0.0, self.busy_s - self.own_s) / self.wall_s if self.wall_s > 0 else 0.0

    def disturbed(self, ranks: int) -> bool:
        """Other processes took more than the cores a run of ``ranks`` ranks leaves free."""
        return self.others_cores > max(0, self.cores - ranks) + SLACK_CORES

    def describe(self) -> str:
        return f"other processes kept {self.others_cores:.2f} of {self.cores} CPUs busy"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "others_cores": round(self.others_cores, 3)}


class CpuMeter:
    """Started when a run starts; ``stop()`` once every process of the run has been waited for."""

    def __init__(self) -> None:
        self.cpus = usable_cpus()
        self.t0 = time.monotonic()
        self.busy0, _ = _busy_s(self.cpus)
        self.own0 = _own_s()

    def stop(self, forked_s: float = 0.0) -> CpuUse:
        """``forked_s``: the CPU of the run's processes that are not this process's children
        (warm-started ranks, ``harness.controller.warm_ranks``)."""
        busy, cores = _busy_s(self.cpus)
        return CpuUse(cores, time.monotonic() - self.t0, busy - self.busy0, _own_s() - self.own0 + forked_s)


def speed_disturbed(world_size: int, cpu: CpuUse | None, neighbours: Neighbours | None,
                    accelerator: str | None) -> str | None:
    """Why a run's speed is not a quiet run's, or None: other processes took more CPUs than its
    ranks left free, or, on a GPU (``accelerator`` not "cpu"), other launches ran beside it for
    most of it."""
    if cpu is not None and cpu.disturbed(world_size):
        return (f"{cpu.describe()} (its {world_size} rank{'s' if world_size != 1 else ''} left "
                f"{max(0, cpu.cores - world_size)} free)")
    if accelerator not in (None, "cpu") and neighbours is not None and neighbours.crowded():
        return f"on the {accelerator} GPU {neighbours.describe()}"
    return None
