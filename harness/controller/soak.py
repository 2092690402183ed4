"""The soak's controller side: each cell (backend x ranks x stream) runs ``SoakJob`` launches
under the watchdog until it has made its calls or spent its time, and counts how they ended.

A launch the watchdog stops for want of progress, while no rank failed, is a hang: it is recorded
with the call it happened at and the ranks' ledgers compared (``RunOutcome.collectives``), and the
cell relaunches for its remaining calls. Any other way a launch fails is a failure, recorded too
(not a hang), and relaunched alike; after ``max_failures`` launches in a row that failed, or hung
before completing a call, the cell stops and says why. Nothing here judges: the rates and their
intervals are ``harness.judge.rates``'s.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.controller.outcome import RunOutcome
from harness.controller.ports import PortError
from harness.controller.run_job import LaunchError, execute
from harness.scenario.job import SoakJob, SoakStop

MIN_LAUNCH_S = 2.0  # a cell with a time limit starts no launch with less time left than this
MAX_FAILURES = 5
UNCAPPED_WALL_S = 7 * 86400.0  # a cell without a time limit: its launches end by calls or watchdog
STREAMS = ("cpu", "default")


@dataclass(frozen=True)
class Cell:
    """One soak cell: a backend, a rank count and a stream ("cpu" or "default")."""

    backend: str
    ranks: int
    stream: str

    @property
    def name(self) -> str:
        return f"{self.backend}-{self.ranks}ranks-{self.stream}"


@dataclass(frozen=True)
class SoakSpec:
    """What every cell runs: ``job`` (its sizes), ``calls`` per cell (None: no count) and
    ``seconds`` per cell (None: no time limit), ``watchdog_s`` without progress before a launch is
    a hang; ``stop``: a planted hang in the cell's first launches, until it has fired."""

    job: SoakJob
    calls: int | None
    seconds: float | None
    watchdog_s: float
    max_failures: int = MAX_FAILURES
    stop: SoakStop | None = None


@dataclass
class Stoppage:
    """A launch that did not finish: a hang (``kind`` "hang") or a failure ("failure")."""

    kind: str
    launch: int
    at_call: int  # the cell's first call that not every rank completed (1-based)
    detail: str  # the watchdog's words, or the failure's first line
    collectives: dict[str, Any] | None  # the ranks' ledgers compared (``harness.controller.ledgers``)
    files: str | None = None  # where the launch's rank files were kept
    planted: bool = False  # the spec's planted stop caused it

    @property
    def line(self) -> str:
        said = (self.collectives or {}).get("line") or "no ledgers to compare"
        return f"{self.who} stopped answering; {said}" if self.who else said

    @property
    def who(self) -> str | None:
        """The ranks that stopped answering: those whose ledger is behind the others'."""
        behind = (self.collectives or {}).get("behind") or []
        return ("rank " if len(behind) == 1 else "ranks ") + ", ".join(map(str, behind)) if behind else None

    def to_json(self) -> dict[str, Any]:
        behind = (self.collectives or {}).get("behind")
        return {**dataclasses.asdict(self), "line": self.line, "stopped_answering": behind}


@dataclass
class CellResult:
    """What a cell did: its calls completed on every rank, launches, stoppages and call times."""

    cell: Cell
    calls: int = 0
    launches: int = 0
    wall_s: float = 0.0
    queued_s: float = 0.0  # of it, launches waiting for rank slots beside other launches (``rank_budget``)
    calls_s: float = 0.0  # of it, rank 0's time from its first call to its last, over the launches that ended ok
    call_ms: list[float] = field(default_factory=list)  # each round's time / its calls, on rank 0
    hangs: list[Stoppage] = field(default_factory=list)
    failures: list[Stoppage] = field(default_factory=list)
    stopped: str | None = None  # why the cell stopped before its calls or time
    arrays: int | None = None  # calls per full round
    round_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.cell), "calls": self.calls, "launches": self.launches,
                "wall_s": self.wall_s, "queued_s": self.queued_s, "calls_s": self.calls_s, "arrays": self.arrays,
                "round_bytes": self.round_bytes, "stopped": self.stopped, "hangs": [h.to_json() for h in self.hangs],
                "failures": [f.to_json() for f in self.failures]}


def completed_calls(outcome: RunOutcome, before: int) -> int:
    """The cell's calls every rank completed by the end of this launch (``before``: at its start)."""
    last = [max((int(e.get("calls") or 0) for e in o.events if e.get("kind") == "step"), default=before)
            for o in outcome.ranks]
    return max(before, min(last, default=before))


def is_hang(outcome: RunOutcome) -> bool:
    """Stopped for want of progress while every rank was still there and none had failed, once a
    rank had issued a collective (before any, the ranks were stuck starting: a failure)."""
    errors = [o for o in outcome.ranks if o.result is not None and o.result.get("status") != "ok"]
    c = outcome.collectives
    started = c is None or c.get("agree") is None or c.get("seq") is not None  # no ledgers: cannot tell
    return outcome.watch.limit == "no_progress" and not outcome.watch.exited_early and not errors and started


def _fired(outcome: RunOutcome) -> bool:
    return any(e.get("kind") == "fault" and e.get("phase") == "soak" for o in outcome.ranks for e in o.events)


def _call_ms(outcome: RunOutcome) -> list[float]:
    steps = [e for e in outcome.ranks[0].events if e.get("kind") == "step"] if outcome.ranks else []
    return [1000 * float(e["round_s"]) / int(e["round_calls"]) for e in steps if e.get("round_calls")]


def _calls_s(outcome: RunOutcome) -> float:
    result = outcome.ranks[0].result if outcome.ranks else None
    return float((result or {}).get("calls_s") or 0.0)


def _wall(left: float | None, watchdog_s: float) -> float:
    return UNCAPPED_WALL_S if left is None else left * 2 + 60 + 2 * watchdog_s


def run_cell(cell: Cell, spec: SoakSpec, keep: Path | None = None,
             tell: Callable[[str], None] | None = None) -> CellResult:
    """Run ``cell`` to its calls or time; ``keep``: where a hung or failed launch's rank files go
    (an ok launch's are not kept); ``tell``: a line per launch."""
    out = CellResult(cell)
    t0 = time.monotonic()
    stop, in_a_row = spec.stop, 0
    while spec.calls is None or out.calls < spec.calls:
        # the cell's time, less what its launches spent queued for rank slots beside other launches
        left = None if spec.seconds is None else spec.seconds - (time.monotonic() - t0 - out.queued_s)
        if left is not None and left < MIN_LAUNCH_S:
            break
        if in_a_row >= spec.max_failures:
            out.stopped = (f"stopped after {in_a_row} launches in a row that failed or hung before completing a "
                           f"call")
            break
        out.launches += 1
        job = dataclasses.replace(spec.job, stream=cell.stream, first_call=out.calls, seconds=left, stop=stop,
                                  calls=None if spec.calls is None else spec.calls - out.calls)
        files = None if keep is None else keep / cell.name / f"launch{out.launches}"
        began = time.monotonic()
        try:
            outcome = execute(f"soak-{cell.name}-{out.launches}", job, cell.ranks, backend=cell.backend,
                              wall_s=_wall(left, spec.watchdog_s), no_progress_s=spec.watchdog_s, keep_to=files)
        except (LaunchError, PortError) as e:
            out.stopped = f"could not launch: {e}"
            break
        before, out.calls = out.calls, completed_calls(outcome, out.calls)
        out.queued_s += outcome.queued_s
        out.call_ms += _call_ms(outcome)
        first = next((e for o in outcome.ranks for e in o.events if e.get("kind") == "step"), None)
        if first is not None:
            out.arrays, out.round_bytes = first.get("arrays"), first.get("round_bytes")
        took = f"{time.monotonic() - began:.1f} s"
        if outcome.ok:
            in_a_row = 0
            out.calls_s += _calls_s(outcome)
            _drop(files)
            _tell(tell, cell, out, f"{out.calls - before} calls, ok ({took})")
            if left is not None:  # the ranks stopped at the time they agreed on
                break
            if spec.calls is not None and out.calls < spec.calls:
                out.stopped = f"launch {out.launches} ended ok after {out.calls} of {spec.calls} calls"
                break
            continue
        planted = stop is not None and _fired(outcome)
        if planted:
            stop = None
        hang = is_hang(outcome)
        detail = outcome.watch.limit_detail if hang else (outcome.failure or "failed").splitlines()[0]
        s = Stoppage("hang" if hang else "failure", out.launches, out.calls + 1, detail, outcome.collectives,
                     None if files is None else str(files), planted)
        (out.hangs if hang else out.failures).append(s)
        in_a_row = 0 if hang and out.calls > before else in_a_row + 1
        _tell(tell, cell, out, f"{out.calls - before} calls, then {s.kind} at call {s.at_call} ({took}): {s.line}"
              if hang else f"{out.calls - before} calls, then failure ({took}): {detail}")
    out.wall_s = time.monotonic() - t0
    return out


def _drop(files: Path | None) -> None:
    """Remove an ok launch's kept files, and the directories above them left empty."""
    if files is None:
        return
    shutil.rmtree(files, ignore_errors=True)
    for d in (files.parent, files.parent.parent):
        try:
            d.rmdir()
        except OSError:
            break


def _tell(tell: Callable[[str], None] | None, cell: Cell, out: CellResult, what: str) -> None:
    if tell is not None:
        tell(f"soak {cell.backend}, {cell.ranks} ranks, {cell.stream} stream: launch {out.launches}: {what}")
