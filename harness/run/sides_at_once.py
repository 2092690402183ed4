"""A paired gate's pair with both sides at once (``gate --side-by-side``): each side on its own
half of this machine's CPUs, the halves swapped every pair so a difference between them lands on
both sides, each side with its own rank budget so neither waits for the other's slots.

Run in turns, a pair's two runs meet the machine at different moments: on 2 shared cores in a
noisy spell, the fastest-steps speed of one run after another varied 5.8 % (1 rank) and 13.6 %
(2 ranks) from pair to pair. Side by side, both meet the same spell: over the 86 pairs of 20
gates of an unchanged build, 2.3 % (1 rank) and 5.2 % (2 ranks) (docs/benchmarks.md). What it
costs: each side has half the cores, so a run of more ranks than its half has cores shares them
(2 ranks on one core here), and a slowdown that leaves a core idle (a wait, a sleep) is partly
hidden by the other rank on that core: a step made 10 % slower by a sleep measured 10 % slower
at 1 rank and 7 % at 2. A side that ends first keeps its half busy until the other ends, so the
other's last runs do not gain an idle neighbour. Where the system cannot pin a process to CPUs
(macOS), the sides run at once unpinned, with no filler. The sides' own rank budgets are apart
from the machine's: other launches on the machine neither wait for them nor are waited for, and
each side's memory claims count against its own budget only.
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

BUSY = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"  # ends with the gate


def _cores(cpus: list[int]) -> list[list[int]]:
    """``cpus`` grouped by physical core (hyperthreads of one core together, as Linux's
    ``thread_siblings_list`` says; each CPU alone where it does not)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for c in cpus:
        try:
            text = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text().strip()
            key = tuple(sorted(int(x) for part in text.split(",") for x in _span(part)))
        except (OSError, ValueError):
            key = (c,)
        groups.setdefault(key, []).append(c)
    return sorted(groups.values())


def _span(part: str) -> range:
    a, _, b = part.partition("-")
    return range(int(a), int(b or a) + 1)


def halves() -> tuple[list[int], list[int]] | None:
    """This process's CPUs in two equal halves that share no physical core (an odd one left
    out), or None where it cannot pin; one line where it has a single CPU."""
    cpus = usable_cpus()
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return None
    if len(cpus) < 2:
        raise ScenarioError(f"--side-by-side: needs at least 2 CPUs to give each side its own, this process has "
                            f"{len(cpus)}")
    cores = _cores(cpus)
    if len(cores) >= 2 and len({len(g) for g in cores}) == 1:
        h = len(cores) // 2
        return [c for g in cores[:h] for c in g], [c for g in cores[h:2 * h] for c in g]
    h = len(cpus) // 2  # cores of unequal sizes, or one core: split its CPUs
    return cpus[:h], cpus[h:2 * h]


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
        for side, p in zip(sides, started, strict=False):  # a side still running (interrupted)
            side.stop(p)
    return [side.finish(p, work / f"{side.label}{k}", store=False) for side, p in zip(sides, started, strict=True)]
