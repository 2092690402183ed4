"""``examples/ddp_train.py`` with its session's calls timed (``observer_effect.py`` runs it bare and
under the harness alike): at each ``run.step`` it notes the time, the seconds spent so far inside
``run.probe`` and ``run.step``, and in the garbage collector (``gc.callbacks``) with its count of
full (generation 2) collections, and the CPU the main thread is on (Linux; -1 elsewhere); at
``run.finish`` it writes those rows and the objects the collector tracked at the first step to a JSON
file in the directory ``TIMES_VAR`` names (``bare-PID.json`` or ``harness-PID.json``). Two clock
reads per call and per collection and one small read of ``/proc`` per step: the same on both sides.
The CPU says which NUMA node the step's host work ran on (``placement``): a GPU's step that launches
many small kernels can run slower from the node away from the GPU.

Where ``TURNS_VAR`` is set (``observer_effect.py --turns K``) the sides of a repeat run at once and
take turns (``Baton``): from the end of step ``--from``, K steps at a time each, so that a machine
drifting in speed drifts under both alike. The seconds spent waiting for a turn are noted like the
calls' and left out of the step."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import select
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

TIMES_VAR = "OBSERVER_EFFECT_TIMES"
TURNS_VAR = "OBSERVER_EFFECT_TURNS"
TURN_WAIT_S = 900.0  # the longest a side waits for its turn before it gives up (the other side stopped)
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


class Baton:
    """This process's turns (``TURNS_VAR``, JSON: ``first``, ``k``, FIFOs ``mine``, ``next`` and
    ``ready``): at the end of step ``first`` it says it is ready and waits for its first turn, then
    every ``k`` steps it hands the turn on and waits for the next. Every FIFO is opened read-write,
    so that neither the opening nor a write waits for a reader (one that has finished included)."""

    def __init__(self, value: str):
        spec = json.loads(value)
        self.first, self.k = int(spec["first"]), int(spec["k"])
        self.mine, self.next, self.ready = (os.open(spec[n], os.O_RDWR) for n in ("mine", "next", "ready"))
        self.holding = False

    def after(self, step: int) -> None:
        """At the end of ``step``: wait for the first turn at ``first``, hand on and wait every ``k`` after."""
        if step < self.first or (step - self.first) % self.k:
            return
        if step == self.first:
            os.write(self.ready, b"r")
        else:
            self.hand_on()
        if not select.select([self.mine], [], [], TURN_WAIT_S)[0]:
            raise SystemExit(f"no turn came in {TURN_WAIT_S:.0f} s: the other side stopped")
        os.read(self.mine, 1)
        self.holding = True

    def hand_on(self) -> None:
        if self.holding:
            os.write(self.next, b"t")
            self.holding = False


def turn_fifos(d: Path, sides: list[str], first: int, k: int) -> tuple[dict[str, str], list[int]]:
    """Each side's ``TURNS_VAR`` value for a ring of ``sides`` (the first hands on to the second, the last
    to the first) in directory ``d``, and the FIFOs opened here read-write: the ready one to read,
    and every side's, kept open so that no turn written is lost before its reader opens it."""
    paths = {side: d / f"turn-{side}" for side in [*sides, "ready"]}
    for path in paths.values():
        path.unlink(missing_ok=True)
        os.mkfifo(path)
    env = {side: json.dumps({"first": first, "k": k, "mine": str(paths[side]), "ready": str(paths["ready"]),
                             "next": str(paths[sides[(i + 1) % len(sides)]])}) for i, side in enumerate(sides)}
    return env, [os.open(paths[side], os.O_RDWR) for side in ["ready", *sides]]


def start_turns(fds: list[int], sides: int) -> None:
    """Once every side has said it is ready (``fds[0]``), the first turn to the first side (``fds[1]``)."""
    got = 0
    while got < sides:
        if not select.select([fds[0]], [], [], TURN_WAIT_S)[0]:
            return  # a side stopped before its window: its run reports why
        got += len(os.read(fds[0], sides - got))
    os.write(fds[1], b"t")


class TimedSession:
    """The session, its ``probe`` and ``step`` timed; everything else passed through."""

    def __init__(self, session: Any):
        self.session = session
        self.marks: list[list[float]] = []
        self.in_probe = self.in_step = self.in_gc = self.in_wait = 0.0
        self.baton = Baton(os.environ[TURNS_VAR]) if os.environ.get(TURNS_VAR) else None
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
        self.session.step(*args, **kwargs)
        done = time.perf_counter()
        self.in_step += done - t
        if self.baton:
            self.baton.after(len(self.marks))
            self.in_wait += time.perf_counter() - done

    def finish(self, params: Any) -> None:
        if os.environ.get(TIMES_VAR):
            side = "bare" if type(self.session).__name__ == "BareSession" else "harness"
            (Path(os.environ[TIMES_VAR]) / f"{side}-{os.getpid()}.json").write_text(
                json.dumps({"rows": self.marks, "objects": self.objects}))
        self.session.finish(params)
        if self.baton:  # the other side's last turn starts after this side has finished
            self.baton.hand_on()


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
    own = [stepped(x, y) - (y[1] - x[1] + y[2] - x[2]) for x, y in zip(rows[first - 1:-1], rows[first:], strict=True)]
    where = list(placement([r[5] for r in rows[first:]])) if len(a) > 5 else []  # each read as its step ended
    return [stepped(a, b) / n - calls, calls, (b[3] - a[3]) / n, (b[4] - a[4]) / n, written["objects"],
            statistics.median(own), *where]


def stepped(a: list[float], b: list[float]) -> float:
    """Seconds from row ``a`` to row ``b`` less those spent waiting for a turn (where recorded)."""
    return b[0] - a[0] - (b[6] - a[6] if len(a) > 6 else 0.0)


def window_seconds(written: dict[str, Any], first: int) -> float:
    """The window's seconds (from step ``first`` to the last) less those spent waiting for a turn."""
    return stepped(written["rows"][first - 1], written["rows"][-1])


if __name__ == "__main__":
    main()
