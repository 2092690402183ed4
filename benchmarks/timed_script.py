"""``examples/ddp_train.py`` with its session's calls timed (``observer_effect.py`` runs it bare and
under the harness alike): at each ``run.step`` it notes the time, the seconds spent so far inside
``run.probe`` and ``run.step``, and in the garbage collector (``gc.callbacks``) with its count of
full (generation 2) collections, and the CPU the main thread is on (Linux; -1 elsewhere); at
``run.finish`` it writes those rows and the objects the collector tracked at the first step to a JSON
file in the directory ``TIMES_VAR`` names (``bare-PID.json`` or ``harness-PID.json``). Two clock
reads per call and per collection and one small read of ``/proc`` per step: the same on both sides.
The CPU says which NUMA node the step's host work ran on (``placement``): a GPU's step that launches
many small kernels can run slower from the node away from the GPU.

Where the sides of a repeat take turns (``observer_effect.py --turns K``, ``harness.rank.turns``),
the seconds ``run.step`` spent waiting for a turn are noted apart and left out of the step."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from harness.rank import turns

TIMES_VAR = "OBSERVER_EFFECT_TIMES"
SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "ddp_train.py"


def cpu_now() -> int:
    """The CPU the calling thread runs on (field 39 of ``/proc/thread-self/stat``), -1 where unknown."""
    try:
        stat = Path("/proc/thread-self/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[36])
    except (OSError, ValueError, IndexError):
        return -1


def node_of(cpu: int) -> int:
    """The NUMA node of ``cpu`` (Linux's sysfs), -1 where unknown."""
    found = sorted(Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*")) if cpu >= 0 else []
    return int(found[0].name[4:]) if found else -1


def node_cpus(node: int) -> set[int]:
    """The CPUs of NUMA node ``node`` (sysfs ``cpulist``, as ``0-7,16-23``); ValueError where none."""
    try:
        text = Path(f"/sys/devices/system/node/node{node}/cpulist").read_text()
    except OSError:
        raise ValueError(f"this machine has no NUMA node {node} ({numa_layout()})") from None
    cpus = cpu_list(text)
    if not cpus:
        raise ValueError(f"NUMA node {node} has no CPUs ({numa_layout()})")
    return cpus


def cpu_list(text: str) -> set[int]:
    """The CPUs a kernel CPU list names (``0-7,16-23``)."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def placement(cpus: list[int]) -> tuple[int, float]:
    """The NUMA node most of ``cpus`` (a CPU read as each step ended) lie on, and their share (-1, 0: unknown)."""
    nodes = Counter(node_of(c) for c in cpus if c >= 0)
    if not nodes:
        return -1, 0.0
    node, count = nodes.most_common(1)[0]
    return node, count / len(cpus)


def numa_layout() -> str:
    """This machine's NUMA nodes and the nodes its NVIDIA GPUs hang off (sysfs; Linux), in words."""
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    gpus = []
    for dev in sorted(Path("/sys/bus/pci/devices").glob("*")):
        try:
            if (dev / "vendor").read_text().strip() == "0x10de" and (dev / "class").read_text().startswith("0x03"):
                gpus.append(f"{dev.name} on node {(dev / 'numa_node').read_text().strip()}")
        except OSError:
            continue
    return f"{len(nodes) or 'no'} NUMA nodes; NVIDIA GPUs: {', '.join(gpus) or 'none'}"


class TimedSession:
    """The session, its ``probe`` and ``step`` timed; everything else passed through."""

    def __init__(self, session: Any):
        self.session = session
        self.marks: list[list[float]] = []
        self.in_probe = self.in_step = self.in_gc = self.in_wait = 0.0
        self.full_collections, self.objects = 0, 0
        self._gc_began = 0.0
        gc.callbacks.append(self._collecting)

    def _collecting(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
            return
        self.in_gc += time.perf_counter() - self._gc_began
        self.full_collections += info["generation"] == 2

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def probe(self, *args: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        self.session.probe(*args, **kwargs)
        self.in_probe += time.perf_counter() - t

    def step(self, *args: Any, **kwargs: Any) -> None:
        cpu = cpu_now()  # the script's own time, on both sides alike
        t = time.perf_counter()
        self.marks.append([t, self.in_probe, self.in_step, self.in_gc, self.full_collections, cpu, self.in_wait])
        if len(self.marks) == 1:
            self.objects = len(gc.get_objects())
        baton = turns.baton()  # the session's step waits for the turns (bare and under the harness alike)
        before = baton.waited if baton else 0.0
        self.session.step(*args, **kwargs)
        waited = baton.waited - before if baton else 0.0
        self.in_step += time.perf_counter() - t - waited
        self.in_wait += waited

    def finish(self, params: Any) -> None:
        if os.environ.get(TIMES_VAR):
            side = "bare" if type(self.session).__name__ == "BareSession" else "harness"
            (Path(os.environ[TIMES_VAR]) / f"{side}-{os.getpid()}.json").write_text(
                json.dumps({"rows": self.marks, "objects": self.objects}))
        self.session.finish(params)


class TimedApi:
    """What the script sees as ``harness.api``: its session, timed."""

    def __init__(self, api: Any):
        self.api = api

    def session(self) -> TimedSession:
        return TimedSession(self.api.session())


def main() -> None:
    spec = importlib.util.spec_from_file_location("ddp_train", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.api = TimedApi(script.api)
    script.main()


def split(written: dict[str, Any], first: int) -> list[float]:
    """Per step from step ``first`` to the last: the script's own seconds, the seconds inside the
    session's calls, the seconds in the garbage collector (inside either), the full collections;
    the objects the collector tracked at the first step; the median of the script's own seconds; the
    NUMA node most of the window's steps ended on and their share (``placement``; where recorded)."""
    rows = written["rows"]
    a, b = rows[first - 1], rows[-1]
    n = len(rows) - first
    calls = (b[1] - a[1] + b[2] - a[2]) / n
    own = own_steps(written, first)
    where = list(placement([r[5] for r in rows[first:]])) if len(a) > 5 else []  # each read as its step ended
    return [stepped(a, b) / n - calls, calls, (b[3] - a[3]) / n, (b[4] - a[4]) / n, written["objects"],
            statistics.median(own), *where]


def own_steps(written: dict[str, Any], first: int) -> list[float]:
    """The script's own seconds in each step after ``first`` (the time inside the session's calls
    and any wait for a turn left out), in step order: a record keeps them, so that a cost can be
    placed within the window (``own_table``)."""
    rows = written["rows"][first - 1:]
    return [stepped(x, y) - (y[1] - x[1] + y[2] - x[2]) for x, y in zip(rows[:-1], rows[1:], strict=True)]


def own_table(own: dict[str, list[list[float]]], sides: list[str], turns: int | None, level: float) -> str:
    """Each side's own step over the last side's (bare, where it is one), the ratio of their mean
    own step per repeat with its interval (above 1: the first side's own step is longer), and, taking
    turns, each side's mean own ms by a step's place in its turn (a cost on the first step after the
    other side's turn is one of coming back, not of the step). ``own``: per side, the repeats' own
    seconds a step (``own_steps``); repeats without them (older records) are left out."""
    from repeat_ratios import Ratios
    from tabulate import tabulate

    base = sides[-1]
    both = [i for i in range(min(len(own[x]) for x in sides)) if all(own[x][i] for x in sides)]
    if not both:
        return ""
    rows = []
    for side in sides[:-1]:
        r = Ratios(tuple(statistics.fmean(own[side][i]) / statistics.fmean(own[base][i]) for i in both), level)
        lo, hi = r.interval()
        rows.append([f"{side} / {base}", len(both), f"{r.mean:.4f} [{lo:.4f}, {hi:.4f}]"])
    lines = [tabulate(rows, headers=["own step", "repeats", "mean [interval]"])]
    if turns and turns > 1:
        places = [[side, *(f"{statistics.fmean(v for i in both for v in own[side][i][k::turns]) * 1e3:.2f}"
                           for k in range(turns))] for side in sides]
        lines.append(tabulate(places, headers=["side", *(f"own ms, step {k + 1} of a turn" for k in range(turns))],
                              disable_numparse=True))
    return "\n\n".join(lines)


def stepped(a: list[float], b: list[float]) -> float:
    """Seconds from row ``a`` to row ``b`` less those spent waiting for a turn (where recorded)."""
    return b[0] - a[0] - (b[6] - a[6] if len(a) > 6 else 0.0)


if __name__ == "__main__":
    main()
