"""A machine-wide budget of ranks, so that concurrent launches queue instead of oversubscribing.

Every launch holds one slot per rank while its ranks run. Slots are files in a directory shared
by every controller of the user on the machine (CLI runs, pytest-xdist workers), each held with
an exclusive ``flock``: a slot is free again the moment its holder releases it or dies. A launch
takes all its slots at once under a directory lock, or none, so two launches never each hold a
part and wait for the other. The budget is ``MLX_DDP_HARNESS_RANK_BUDGET`` or the number of
CPU cores; a launch of more ranks than the budget waits for the whole budget.

Launches that must wait are served in turn: the first to wait takes a numbered ticket (a
``queue-*`` file held with ``flock``, gone when its holder dies), and no launch takes slots while
an older ticket waits. Without turns, a launch of 2 ranks waited behind another process's
stream of 1-rank launches for as long as the stream lasted (5 minutes of a test under
``pytest -n 2``), with one core idle.

A holder that starts launches of its own (a pytest test marked with its world size) sets
``MLX_DDP_HARNESS_RANKS_HELD`` for its process and children: a launch there counts those slots
as its own and takes only what it needs beyond them, so it never waits for its own holder; it
does not wait its turn either (the launch ahead of it may be waiting for its holder's slots).

A held slot's file names its holder; a run's watchdog reads the names (``NeighbourMeter``) to
say which part of the run other launches ran beside it, sharing its GPU where it has one.

Memory is budgeted the same way: a launch that says what its ranks are expected to hold
(``memory_bytes``: ranks x the expected per-rank peak, ``harness.memory.plan``) also claims that
much of the machine's memory budget (``MLX_DDP_HARNESS_MEMORY_BUDGET``, else the working set):
a ``mem-*`` file in the same directory, held with ``flock`` and holding the bytes and the holder.
It is taken with its slots, under the same lock, only while the live claims (files whose lock is
held; a dead holder's are removed) and its own fit the budget; a launch larger than the budget
waits until no other claim is left. A launch of ranks its holder's slots cover
(``MLX_DDP_HARNESS_RANKS_HELD``) still claims its memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from harness.memory.plan import format_size, machine_budget

BUDGET_VAR = "MLX_DDP_HARNESS_RANK_BUDGET"
DIR_VAR = "MLX_DDP_HARNESS_RANK_DIR"
HELD_VAR = "MLX_DDP_HARNESS_RANKS_HELD"
NOTICE_AFTER_S = 5.0
SAMPLE_S = 0.5  # how often a run's watchdog looks for other launches (``NeighbourMeter``)
CROWDED_SHARE = 0.5


def budget() -> int:
    """Ranks that may run at once on this machine."""
    raw = os.environ.get(BUDGET_VAR)
    if raw is None or raw == "":
        return os.cpu_count() or 1
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{BUDGET_VAR}={raw!r}: the rank budget must be a whole number of ranks, at least 1")
    return value


def slot_dir() -> Path:
    """One directory per user and machine, whatever TMPDIR a controller runs with."""
    base = Path("/tmp") if Path("/tmp").is_dir() else Path(tempfile.gettempdir())
    d = Path(os.environ.get(DIR_VAR) or base / f"mlx-ddp-harness-ranks-{os.getuid()}")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


@dataclass
class RankSlots:
    """Slots held until ``release``; ``waited_s``: how long the launch queued for them."""

    held: list[IO[str]] = field(default_factory=list)
    waited_s: float = 0.0
    memory: IO[str] | None = None  # its claim on the machine's memory budget

    def release(self) -> None:
        if self.memory is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.memory.name)  # removed while still locked: no one counts it as stale
                fcntl.flock(self.memory, fcntl.LOCK_UN)
            self.memory.close()
            self.memory = None
        for f in self.held:
            with contextlib.suppress(OSError):
                f.seek(0)
                f.truncate()  # a free slot names no holder (``others_holding`` reads the names)
                f.flush()
                fcntl.flock(f, fcntl.LOCK_UN)
            f.close()
        self.held = []


def _holder_pid(text: str) -> int | None:
    m = re.search(r"\(pid (\d+)\)$", text.strip())
    return int(m.group(1)) if m else None


def others_holding(mine: RankSlots, ours: set[int]) -> int:
    """Slots held now by a live process outside ``ours`` (this controller and its parents),
    other than ``mine``: other launches that share this machine's devices."""
    own = {Path(f.name).name for f in mine.held}
    n = 0
    for path in slot_dir().glob("slot-*"):
        if path.name in own:
            continue
        try:
            pid = _holder_pid(path.read_text())
        except OSError:
            continue
        if pid is not None and pid not in ours and psutil.pid_exists(pid):
            n += 1
    return n


@dataclass
class Neighbours:
    """How often other launches held rank slots while a run ran, sampled by its watchdog."""

    samples: int = 0
    shared: int = 0  # samples in which another launch held slots
    most: int = 0  # the most slots other launches held at once

    @property
    def share(self) -> float:
        return self.shared / self.samples if self.samples else 0.0

    def crowded(self) -> bool:
        """Other launches ran beside it for more than half of the run."""
        return self.share > CROWDED_SHARE

    def describe(self) -> str:
        return f"other launches held rank slots for {self.share:.0%} of it (up to {self.most} at once)"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "share": round(self.share, 3)}


class NeighbourMeter:
    """Samples ``others_holding`` at most every ``SAMPLE_S`` while a run holding ``mine`` runs."""

    def __init__(self, mine: RankSlots):
        self.mine = mine
        self.ours = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
        self.seen = Neighbours()
        self.last = 0.0

    def poll(self) -> None:
        now = time.monotonic()
        if now - self.last < SAMPLE_S:
            return
        self.last = now
        n = others_holding(self.mine, self.ours)
        self.seen.samples += 1
        self.seen.shared += n > 0
        self.seen.most = max(self.seen.most, n)

    def stop(self) -> Neighbours:
        return self.seen


def _try_take(d: Path, want: int, size: int, what: str) -> tuple[list[IO[str]], list[str]]:
    """The slots taken (each file then names its holder), or none and who holds the busy ones."""
    got: list[IO[str]] = []
    busy: list[str] = []
    for i in range(size):
        f = open(d / f"slot-{i}", "a+")  # noqa: SIM115 - held open for as long as the slot is
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            busy.append(f.read().strip() or "a process that did not say")
            f.close()
            continue
        f.seek(0)
        f.truncate()
        f.write(f"{what} (pid {os.getpid()})")
        f.flush()
        got.append(f)
        if len(got) == want:
            return got, []
    RankSlots(got).release()
    return [], busy


def holders(busy: list[str]) -> str:
    """``busy`` slot holders as one phrase: each holder once, with how many slots it holds."""
    return "; ".join(f"{n} by {b}" for b, n in Counter(busy).items())


def held_here() -> int:
    """Slots a holder of this process (or a parent) already holds for the launches made here."""
    try:
        return max(0, int(os.environ.get(HELD_VAR) or 0))
    except ValueError:
        return 0


MEMORY_PREFIX = "mem-"
QUEUE_PREFIX = "queue-"
_claims_made = 0


def _ticket(d: Path) -> IO[str]:
    """A numbered place in the queue, held until released (called under the directory lock)."""
    seq_file = d / ".seq"
    try:
        seq = int(seq_file.read_text() or 0) + 1
    except (OSError, ValueError):
        seq = 1
    seq_file.write_text(str(seq))
    f = open(d / f"{QUEUE_PREFIX}{seq:012d}-{os.getpid()}", "w")  # noqa: SIM115 - held while it waits
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def _drop_ticket(f: IO[str] | None) -> None:
    if f is None:
        return
    with contextlib.suppress(OSError):
        os.unlink(f.name)
        fcntl.flock(f, fcntl.LOCK_UN)
    f.close()


def _live(d: Path, prefix: str) -> list[tuple[Path, str]]:
    """The files of ``prefix`` whose holder still holds its lock, in name order, with their text;
    a dead holder's file is removed. Called under the directory lock."""
    out = []
    for path in sorted(d.glob(f"{prefix}*")):
        try:
            f = open(path)  # noqa: SIM115 - closed below, after its lock is tested
        except OSError:
            continue
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held: its holder lives
                out.append((path, f.read()))
                continue
            with contextlib.suppress(OSError):
                path.unlink()  # its holder died, and its lock with it
    return out


def _first_waiting(d: Path) -> str | None:
    """The name of the oldest live ticket."""
    waiting = _live(d, QUEUE_PREFIX)
    return waiting[0][0].name if waiting else None


def memory_claims(d: Path) -> list[tuple[int, str]]:
    """(bytes, holder) of each live claim on the memory budget; a dead holder's claim is removed.
    Called under the directory lock."""
    out = []
    for _, text in _live(d, MEMORY_PREFIX):
        size, _, holder = text.partition(" ")
        out.append((int(size) if size.isdigit() else 0, holder.strip() or "a process that did not say"))
    return out


def _claim(d: Path, nbytes: int, what: str) -> IO[str]:
    global _claims_made
    _claims_made += 1
    f = open(d / f"{MEMORY_PREFIX}{os.getpid()}-{_claims_made}", "w")  # noqa: SIM115 - held while the claim is
    fcntl.flock(f, fcntl.LOCK_EX)
    f.write(f"{nbytes} {what} (pid {os.getpid()})")
    f.flush()
    return f


def claimed(claims: list[tuple[int, str]]) -> str:
    """Live claims as one phrase: each holder with its bytes."""
    return "; ".join(f"{format_size(n)} by {h}" for n, h in claims) or "none"


def hold(ranks: int, what: str = "a launch", poll_s: float = 0.05, memory_bytes: int = 0,
         stop: Callable[[], None] | None = None) -> RankSlots:
    """Wait until ``ranks`` slots (at most the budget, less those ``held_here``) are free and
    ``memory_bytes`` fit the memory budget beside the live claims, and take them. ``stop`` is
    called between looks: what it raises ends the wait, taking nothing."""
    size = budget()
    want = min(ranks, size) - min(held_here(), size)
    memory_bytes = max(0, int(memory_bytes))
    if want <= 0 and memory_bytes == 0:
        return RankSlots()
    mem = machine_budget() if memory_bytes else None
    d = slot_dir()
    t0 = time.monotonic()
    noticed = False
    queues = held_here() == 0  # a holder's own launches never wait behind a launch waiting for it
    ticket: IO[str] | None = None
    try:
        while True:
            busy: list[str] = []
            claims: list[tuple[int, str]] = []
            with open(d / ".lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    first = _first_waiting(d) if queues else None
                    my_turn = first is None or (ticket is not None and Path(ticket.name).name == first)
                    claims = memory_claims(d) if mem is not None else []
                    used = sum(n for n, _ in claims)
                    fits = my_turn and (mem is None or not claims or used + memory_bytes <= mem.bytes)
                    got: list[IO[str]] = []
                    if fits and want > 0:
                        got, busy = _try_take(d, want, size, what)
                    if fits and (got or want <= 0):
                        claim = _claim(d, memory_bytes, what) if memory_bytes else None
                        return RankSlots(got, time.monotonic() - t0, claim)
                    if queues and ticket is None:
                        ticket = _ticket(d)
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
            waited = time.monotonic() - t0
            if not noticed and waited >= NOTICE_AFTER_S:
                noticed = True
                if not my_turn:
                    print(f"{what}: waiting for {want} of this machine's {size} rank slots ({BUDGET_VAR}) behind "
                          f"launches that waited first", file=sys.stderr, flush=True)
                elif busy or mem is None:
                    print(f"{what}: waiting for {want} of this machine's {size} rank slots ({BUDGET_VAR}); "
                          f"held: {holders(busy)}", file=sys.stderr, flush=True)
                else:
                    print(f"{what}: waiting for {format_size(memory_bytes)} of this machine's memory budget of "
                          f"{format_size(mem.bytes)} ({mem.source}); claimed: {claimed(claims)}",
                          file=sys.stderr, flush=True)
            time.sleep(poll_s)
            if stop is not None:
                stop()
    finally:
        _drop_ticket(ticket)
