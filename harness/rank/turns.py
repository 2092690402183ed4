"""Taking turns with another process, for a benchmark alone (``benchmarks/taking_turns.py``: the
observer effect's two sides, the reference and the bare step): two runs train at once and step in
turns, so that a machine whose speed wanders falls on both alike. Where ``VAR`` is set (JSON:
``first``, ``k``, the FIFOs ``mine``, ``next`` and ``ready``, a ``log`` file and, where given, the
``owner``: the pid of the benchmark that set the turns), this process's
baton (``baton``) says it is ready at the end of step ``first`` and waits for its first turn; every
``k`` steps after, it hands the turn on and waits for the next. Each wait is logged (its start and
end, ``time.time()``) so that the benchmark leaves it out of the window it times. Every FIFO is
opened read-write, so that neither the opening nor a write waits for a reader (one that has
finished included). A wait gives up once the owner is gone (a benchmark killed with SIGKILL
leaves no one to collect the run), else after ``WAIT_S``. Unset, nothing here runs."""

from __future__ import annotations

import json
import os
import select
import time
from pathlib import Path

import psutil

VAR = "MLX_DDP_HARNESS_TURNS"
WAIT_S = 900.0  # the longest a side waits for its turn before it gives up (the other side stopped)
OWNER_POLL_S = 1.0  # how often a wait looks whether the benchmark that set the turns is still there


class Baton:
    """One process's turns (module docstring)."""

    def __init__(self, spec: dict[str, str | int]):
        self.first, self.k = int(spec["first"]), int(spec["k"])
        self.mine, self.next, self.ready = (os.open(str(spec[n]), os.O_RDWR) for n in ("mine", "next", "ready"))
        self.log = str(spec["log"])
        self.owner = int(spec["owner"]) if spec.get("owner") is not None else None
        self.holding = False
        self.waited = 0.0  # seconds spent waiting for turns so far

    def after(self, step: int) -> float:
        """At the end of ``step``: wait for the first turn at ``first``, hand on and wait every ``k``
        after; the seconds waited."""
        if step < self.first or (step - self.first) % self.k:
            return 0.0
        began = time.time()
        if step == self.first:
            os.write(self.ready, b"r")
        else:
            self.hand_on()
        self._wait(began)
        os.read(self.mine, 1)
        self.holding = True
        ended = time.time()
        self.waited += ended - began
        with open(self.log, "a") as f:
            f.write(f"{began!r} {ended!r}\n")
        return ended - began

    def _wait(self, began: float) -> None:
        """Until this side's turn is there to read; SystemExit in one line where the benchmark that
        set the turns is gone or no turn came in ``WAIT_S``."""
        while not select.select([self.mine], [], [], min(OWNER_POLL_S, WAIT_S))[0]:
            if self.owner is not None and not psutil.pid_exists(self.owner):
                raise SystemExit(f"the benchmark that set the turns (pid {self.owner}) is gone: no turn will come")
            if time.time() - began >= WAIT_S:
                raise SystemExit(f"no turn came in {WAIT_S:.0f} s: the other side stopped")

    def hand_on(self) -> None:
        """The turn to the next side, where this one holds it (also at the end of training)."""
        if self.holding:
            os.write(self.next, b"t")
            self.holding = False


_baton: Baton | None = None


def baton() -> Baton | None:
    """This process's baton where ``VAR`` is set (one a process: whoever reports its steps and
    whoever times them share it), else None."""
    global _baton
    if _baton is None and os.environ.get(VAR):
        _baton = Baton(json.loads(os.environ[VAR]))
    return _baton


def after(step: int) -> float:
    """At the end of ``step``: this process's turns (``Baton.after``), where it takes them; the
    seconds waited."""
    return baton().after(int(step)) if baton() is not None else 0.0


def hand_on() -> None:
    """Training is over: the other side's last turn, where this process takes turns."""
    if baton() is not None:
        baton().hand_on()


def waits(log: str | os.PathLike[str]) -> list[tuple[float, float]]:
    """The waits a baton logged (none where it logged nothing)."""
    try:
        text = Path(log).read_text()
    except FileNotFoundError:
        return []
    return [(float(a), float(b)) for a, b in (line.split() for line in text.splitlines() if line.strip())]


def waited_within(log: str | os.PathLike[str], start: float, end: float) -> float:
    """Seconds of the logged waits that fall between ``start`` and ``end``."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in waits(log))
