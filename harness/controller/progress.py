"""A run's progress while it runs, read from the events its ranks already write.

``RunProgress`` is a snapshot a display reads: where each rank is (phase, last step), the
step rate and tokens/s of the last steps, and an ETA. ``ProgressFeed`` keeps it current while
the watchdog polls: it reads only what each rank's event file gained since the last read and
tells its observer when something changed (and once a second, so an ETA keeps counting).
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness import schema

RATE_STEPS = 8  # tokens/s and seconds per step over rank 0's last steps
TICK_S = 1.0


@dataclass
class RankProgress:
    """One rank: its phase ("start", "data", "model", "train", ...) and last optimizer step."""

    phase: str = "starting"
    step: int = 0


@dataclass
class RunProgress:
    """A run of a scenario as it goes: ``state`` is "queued" (waiting for rank slots),
    "running" or "done"."""

    scenario: str
    run: str
    world_size: int
    steps: int
    state: str = "queued"
    ranks: dict[int, RankProgress] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    recent: deque = field(default_factory=lambda: deque(maxlen=RATE_STEPS))  # (step_time_s, tokens_global)
    result: str = ""  # when done: "ok" or the failure's first line

    @property
    def step(self) -> int:
        """The step every rank has reached (the slowest rank's)."""
        return min((r.step for r in self.ranks.values()), default=0) if len(self.ranks) == self.world_size else 0

    @property
    def tok_s(self) -> float | None:
        spent = sum(t for t, _ in self.recent)
        return sum(n for _, n in self.recent) / spent if spent > 0 else None

    @property
    def eta_s(self) -> float | None:
        if not self.recent or self.step >= self.steps:
            return None
        per_step = sum(t for t, _ in self.recent) / len(self.recent)
        return per_step * (self.steps - self.step)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def describe(self) -> str:
        """One plain line: where the run is."""
        where = f"{self.scenario}/{self.run} ({self.world_size} rank{'s' if self.world_size > 1 else ''})"
        if self.state != "running":
            return f"{where}: {self.state}{f' ({self.result})' if self.result else ''} after {self.elapsed_s:.0f}s"
        ranks = ", ".join(f"r{r} {p.step if p.phase == 'train' else p.phase}" for r, p in sorted(self.ranks.items()))
        rate = f", {self.tok_s:.0f} tok/s" if self.tok_s else ""
        eta = f", ETA {self.eta_s:.0f}s" if self.eta_s is not None else ""
        return f"{where}: step {self.step}/{self.steps} [{ranks or 'starting'}]{rate}{eta}, {self.elapsed_s:.0f}s"


Observer = Callable[[RunProgress], None]


class EventTail:
    """The complete lines a rank's event file gained since the last read."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a progress display never fails a run; collect() judges the files
        return out


class ProgressFeed:
    """Feeds ``observer`` a run's ``RunProgress`` from its ranks' event files."""

    def __init__(self, progress: RunProgress, observer: Observer | None):
        self.progress, self.observer = progress, observer
        self.tails: list[EventTail] = []
        self.last_tick = 0.0

    def start(self, run_dir: Path) -> None:
        """The ranks were started in ``run_dir``."""
        self.tails = [EventTail(schema.events_path(run_dir, r)) for r in range(self.progress.world_size)]
        self.progress.state, self.progress.started = "running", time.monotonic()
        self._tell()

    def poll(self, changed: bool) -> None:
        """The watchdog's poll: read what changed; tell the observer on news or once a second."""
        news = False
        if changed:
            for r, tail in enumerate(self.tails):
                for event in tail.read():
                    news = self._apply(r, event) or news
        if news or time.monotonic() - self.last_tick >= TICK_S:
            self._tell()

    def finish(self, result: str) -> None:
        self.progress.state, self.progress.result = "done", result
        self._tell()

    def _apply(self, rank: int, event: dict) -> bool:
        p = self.progress.ranks.setdefault(rank, RankProgress())
        kind = event.get("kind")
        if kind == "phase":
            p.phase = str(event.get("name", p.phase))
        elif kind == "step":
            p.phase, p.step = "train", int(event.get("step", p.step))
            if rank == 0 and event.get("step_time_s"):
                self.progress.recent.append((float(event["step_time_s"]), int(event.get("tokens_global") or 0)))
        elif kind == "start":
            p.phase = "start"
        else:
            return False
        return True

    def _tell(self) -> None:
        self.last_tick = time.monotonic()
        if self.observer is None:
            return
        try:
            self.observer(self.progress)
        except Exception as e:  # noqa: BLE001 - a broken display must not break the run it shows
            self.observer = None
            print(f"progress display stopped: {type(e).__name__}: {e}", file=sys.stderr)
