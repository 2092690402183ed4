"""A paired gate's pair with both sides at once (``gate --side-by-side``): each side on its own
half of this machine's CPUs, the halves swapped every pair so a difference between them lands on
both sides, each side with its own rank budget so neither waits for the other's slots.

Run in turns, a pair's two runs meet the machine at different moments: on 2 shared cores in a
noisy spell, the fastest-steps speed of one run after another varied 5.8 % (1 rank) and 13.6 %
(2 ranks) from pair to pair. Side by side, both meet the same spell: 1.0 to 3.4 % (1 rank) and
3.3 % (2 ranks) in several sittings (docs/benchmarks.md). What it costs: each side has half the
cores, so a run of more ranks than its half has cores shares them (2 ranks on one core here),
and a slowdown that leaves a core idle (a wait, a sleep) is partly hidden by the other rank on
that core: a step made 10 % slower by a sleep measured 10 % slower at 1 rank and 7 % at 2. A
side that ends first keeps its half busy until the other ends, so the other's last runs do not
gain an idle neighbour. Where the system cannot pin a process to CPUs (macOS), the sides run at
once unpinned, with no filler.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.controller.cpu_use import usable_cpus
from harness.controller.rank_budget import DIR_VAR
from harness.scenario import ScenarioError

BUSY = "while True:\n    pass\n"


def halves() -> tuple[list[int], list[int]] | None:
    """This process's CPUs in two halves, or None where it cannot pin (one-line error with one CPU)."""
    cpus = usable_cpus()
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return None
    if len(cpus) < 2:
        raise ScenarioError(f"--side-by-side: needs at least 2 CPUs to give each side its own, this process has "
                            f"{len(cpus)}")
    mid = len(cpus) // 2
    return cpus[:mid], cpus[mid:]


def _pinned(cpus: list[int] | None) -> Any:
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def _fill(cpus: list[int]) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=_pinned([c]), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for c in cpus]


def run_at_once(sides: list[Any], scenarios: list[str], work: Path, k: int,
                split: tuple[list[int], list[int]] | None) -> list[str]:
    """Pair ``k`` (from 0): both sides' runs at the same time, side i on half (i + k) % 2 of
    ``split`` (``halves()``; None: unpinned); each side's "ran" (a side with kept results reruns:
    they were not measured beside this pair's other side)."""
    started: list[subprocess.Popen] = []
    fillers: list[subprocess.Popen] = []
    try:
        for i, side in enumerate(sides):
            cpus = split[(i + k) % 2] if split else None
            env = {DIR_VAR: str(work / f"ranks-{side.label}")}  # its own rank budget
            started.append(side.start(scenarios, work / f"{side.label}{k}", preexec=_pinned(cpus), env=env,
                                      reuse=False))
        running = set(range(len(sides)))
        while running:
            for i in sorted(running):
                if started[i].poll() is not None:
                    running.discard(i)
                    if running and split:
                        fillers += _fill(split[(i + k) % 2])
            time.sleep(0.02)
    finally:
        for p in fillers:
            p.kill()
            p.wait()
        for p in started:  # a side still running (interrupted): asked to stop its ranks first
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    return [side.finish(p, work / f"{side.label}{k}") for side, p in zip(sides, started, strict=True)]
