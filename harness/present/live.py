"""Progress of a scenario suite while it runs: a live display on a terminal (rich), plain
periodic lines where output is not a terminal (CI logs). Both show what ``RunProgress`` holds:
scenario, run, each rank's step of the total, tokens/s and an ETA."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from harness.controller.progress import RunProgress

MODES = ("auto", "live", "plain", "off")
PLAIN_EVERY_S = 10.0


def detail(p: RunProgress) -> str:
    """Ranks, tokens/s and ETA of a running run."""
    ranks = " ".join(f"r{r}:{q.step if q.phase == 'train' else q.phase}" for r, q in sorted(p.ranks.items()))
    rate = f"{p.tok_s:,.0f} tok/s" if p.tok_s else ""
    eta = f"ETA {p.eta_s:.0f}s" if p.eta_s is not None else ""
    return "  ".join(x for x in (ranks, rate, eta) if x)


class PlainProgress:
    """Each running run's line every ``every_s`` seconds (its first once it trains), through
    ``write``; a run's end is the caller's own line."""

    def __init__(self, write: Callable[[str], None], every_s: float = PLAIN_EVERY_S):
        self.write, self.every_s = write, every_s
        self.shown: dict[tuple[str, str], float] = {}

    def __call__(self, p: RunProgress) -> None:
        key = (p.scenario, p.run)
        if p.state != "running":
            self.shown.pop(key, None)
            return
        now = time.monotonic()
        last = self.shown.get(key)
        if (last is None and p.step > 0) or (last is not None and now - last >= self.every_s):
            self.shown[key] = now
            self.write(f"  progress {p.describe()}")

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class LiveProgress:
    """A live display on a terminal: a bar per running run (steps done of the total), its
    ranks' steps, tokens/s and ETA; lines printed meanwhile scroll above it."""

    def __init__(self, stream: TextIO):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(file=stream, force_terminal=True)
        self.bars = Progress(TextColumn("{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                             TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), console=self.console,
                             redirect_stdout=True, redirect_stderr=True)
        self.tasks: dict[tuple[str, str], Any] = {}

    def __call__(self, p: RunProgress) -> None:
        key = (p.scenario, p.run)
        if p.state == "done":
            if key in self.tasks:
                self.bars.remove_task(self.tasks.pop(key))
            return
        if key not in self.tasks:
            self.tasks[key] = self.bars.add_task(f"{p.scenario}/{p.run} ({p.world_size})", total=p.steps or None,
                                                 detail="")
        self.bars.update(self.tasks[key], completed=p.step, detail=p.state if p.state == "queued" else detail(p))

    def __enter__(self) -> LiveProgress:
        self.bars.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bars.stop()


def progress_display(mode: str, stream: TextIO | None = None) -> LiveProgress | PlainProgress | None:
    """The display ``mode`` asks for ("auto": live on a terminal, plain lines otherwise)."""
    stream = stream or sys.stderr
    if mode == "off":
        return None
    if mode == "live" or (mode == "auto" and stream.isatty()):
        return LiveProgress(stream)
    return PlainProgress(lambda line: print(line, file=stream, flush=True))
