"""Failure consensus: every rank calls the same collectives in the same order, always.

A rank never raises on its own between collectives. Each phase (fetching a batch, the local
step, the optimizer update, eval, a save) runs under ``Coordinator.attempt``, which catches the
rank's error and keeps it. The next ``agree`` all-sums one small vector: one slot per rank (0,
or the code of the phase that failed there), one slot per rank for stop requests, then the
caller's integers (a rank without peers reads its own vector: no collective at world size 1).
If any rank failed, every rank also exchanges the failure texts and raises:
the failing rank ``RankFailure("rank 1 failed while fetching a batch at step 3: ...")``, its
peers ``PeerFailure("a peer rank failed: rank 1 failed while ...")``. So no rank is left
waiting in a collective that a failed peer will never call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from harness.rank.context import ReportedFailure

PHASES = {
    "data": "loading the data",
    "model": "building the model",
    "fetch": "fetching a batch",
    "step": "running a training step",
    "probe": "running the step-local parity probe",
    "compile": "compiling the local step",
    "update": "applying the optimizer update",
    "callback": "running a rank-0 callback",
    "eval": "evaluating",
    "checkpoint": "writing a checkpoint",
    "resume": "resuming from a checkpoint",
    "save": "saving",
    "finish": "finishing",
}
_CODES = {name: i + 1 for i, name in enumerate(PHASES)}
_NAMES = {code: name for name, code in _CODES.items()}
TEXT_BYTES = 512


class RankFailure(ReportedFailure):
    """This rank failed; every peer raises ``PeerFailure`` at the same point."""


class PeerFailure(ReportedFailure):
    """Another rank failed; this rank stops with it."""


class AgreedStop(ReportedFailure):
    """Every rank saw the same condition (e.g. zero supervised tokens) and stops with one message."""


@dataclass
class Pending:
    """A failure caught on this rank, waiting for the next agreement."""

    phase: str
    step: int
    error: BaseException

    def text(self) -> str:
        at = f" at step {self.step}" if self.step else ""
        return f"{PHASES[self.phase]}{at}: {type(self.error).__name__}: {self.error}"


@dataclass
class Agreement:
    """What every rank learned from one ``agree``: summed values and who asked to stop."""

    values: list[int]
    stop_ranks: list[int]
    compile_failures: dict[int, str]


class Coordinator:
    """The only place where ranks agree on failures, stops and small integer sums."""

    def __init__(self, group: Any, rank: int, world_size: int):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.pending: Pending | None = None
        self.stop_requested = False
        self.collectives = 0

    def attempt(self, phase: str, step: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn``; an exception is kept for the next ``agree`` instead of raised."""
        if self.pending is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - reported to every rank at the next agreement
            self.pending = Pending(phase, step, e)
            return None

    def fail_later(self, phase: str, step: int, error: BaseException) -> None:
        if self.pending is None:
            self.pending = Pending(phase, step, error)

    def agree(self, values: list[int] | None = None) -> Agreement:
        """All-sum failures, stop requests and ``values``; raise on every rank if any rank failed."""
        n = self.world_size
        values = list(values or [])
        vec = np.zeros(2 * n + len(values), dtype=np.int32)
        if self.pending is not None:
            vec[self.rank] = _CODES[self.pending.phase]
        vec[n + self.rank] = int(self.stop_requested)
        vec[2 * n :] = values
        total = self._summed(vec).tolist()
        codes, stops = total[:n], total[n : 2 * n]
        failed = [r for r in range(n) if codes[r]]
        compile_only = failed and all(_NAMES[codes[r]] == "compile" for r in failed)
        texts = self.exchange(self.pending.text() if self.pending else "") if failed else []
        if failed and not compile_only:
            self.fail_all({r: texts[r] for r in failed if _NAMES[codes[r]] != "compile"})
        compile_failures = {r: texts[r] for r in failed} if compile_only else {}
        if self.pending is not None and self.pending.phase == "compile":
            self.pending = None
        return Agreement(total[2 * n :], [r for r in range(n) if stops[r]], compile_failures)

    def fail_all(self, failures: dict[int, str]) -> NoReturn:
        """Stop this rank for agreed ``failures`` (rank -> what it was doing and its error)."""
        if self.rank in failures:
            cause = self.pending.error if self.pending is not None else None
            error: ReportedFailure = RankFailure(f"rank {self.rank} failed while {failures[self.rank]}")
        else:
            cause, first = None, min(failures)
            others = f" (and ranks {sorted(set(failures) - {first})})" if len(failures) > 1 else ""
            error = PeerFailure(f"a peer rank failed: rank {first} failed while {failures[first]}{others}")
        error.after_record = self.settle
        raise error from cause

    def stop_all(self, message: str) -> AgreedStop:
        """The stop every rank raises for a condition all of them saw alike (``raise
        coord.stop_all(...)``); each settles after writing its result, as for an agreed failure."""
        error = AgreedStop(message)
        error.after_record = self.settle
        return error

    def settle(self) -> None:
        """One more all-sum, once this rank wrote its result for an agreed failure or stop: every rank has
        then written its own before any exits (the first rank to exit non-zero has mlx.launch stop
        the others, and a cause stopped before its record would be named only by its peers)."""
        import mlx.core as mx

        if self.world_size > 1:
            mx.eval(mx.distributed.all_sum(mx.array(0), group=self.group))

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (float32, the same length on every rank), on every rank."""
        buf = np.zeros((self.world_size, len(values)), dtype=np.float32)
        buf[self.rank] = values
        return self._summed(buf).tolist()

    def exchange(self, text: str) -> list[str]:
        """Every rank's ``text`` (UTF-8, cut to 512 bytes), on every rank: one all-sum."""
        buf = np.zeros((self.world_size, TEXT_BYTES), dtype=np.int32)
        raw = text.encode("utf-8")[:TEXT_BYTES]
        buf[self.rank, : len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        return [bytes(row[row > 0].astype(np.uint8)).decode("utf-8", errors="replace") for row in self._summed(buf)]

    def _summed(self, buf: np.ndarray) -> np.ndarray:
        """``buf`` summed over the ranks (one all-sum, counted); a rank without peers has its own."""
        self.collectives += 1
        if self.world_size == 1:
            return buf
        import mlx.core as mx

        return np.array(mx.distributed.all_sum(mx.array(buf), group=self.group))
