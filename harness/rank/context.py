"""What a job sees of the rank process it runs in (``RankContext``), the failure a rank reports
as it stands (``ReportedFailure``), and the faults a scenario injects into a rank (``inject``).
The rank entry point (``harness.rank.entry``) builds the context and runs the job."""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import schema
from harness.memory.sampler import MemorySampler
from harness.rank.startup import StartupClock
from harness.scenario import FaultSpec
from harness.scenario.job import Job


class ReportedFailure(RuntimeError):
    """An error whose message already names the rank and the cause; written to the result as is."""

    after_record: Callable[[], None] | None = None  # called once the rank's result is written (rank.entry)


@dataclass
class RankContext:
    """What a job needs to know about the process it runs in."""

    run_dir: Path
    job: Job
    rank: int
    world_size: int
    group: Any
    backend: str
    events: schema.EventWriter
    faults: list[FaultSpec] = field(default_factory=list)
    host: str = field(default_factory=socket.gethostname)
    memory: MemorySampler | None = None  # trainers tell it of each step (``step_memory``)
    startup: StartupClock | None = None  # times the phases before training

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def step_memory(self, step: int) -> dict[str, Any]:
        """Optimizer step ``step`` ended: the memory fields of its ``step`` event
        (``MemorySampler.step_ended``)."""
        if self.memory is None:
            raise RuntimeError("this rank has no memory sampler: steps are trained under harness.rank.entry.main")
        return self.memory.step_ended(step)

    def phase(self, name: str) -> None:
        """Heartbeat between steps, so the watchdog sees progress through long phases; the
        phases before ``train`` are timed as start-up."""
        if self.startup is not None:
            self.startup.phase(name)
        self.events.emit("phase", name=name, rank=self.rank)

    def maybe_fault(self, phase: str, step: int) -> FaultSpec | None:
        """Misbehave as the job's fault specs say, when this rank reaches ``phase`` of ``step``.

        Process-level faults happen here. Faults the caller must act out are returned: ``stop``
        (request a stop); in the ``step`` phase ``raise`` and ``compile_error`` (for the model's
        forward to raise them, inside a compiled function when there is one); checkpoint damage;
        ``stale_view`` while resuming.
        """
        for f in self.faults:
            if f.rank == self.rank and f.step == step and f.phase == phase:
                if f.action in RETURNED.get(phase, ()):
                    return f
                # when and where it misbehaved, for the controller's detection times
                self.events.emit("fault", rank=self.rank, step=step, phase=phase, action=f.action)
                inject(f)
        return None


RETURNED = {
    "step": ("stop", "raise", "compile_error"),
    "eval": ("stop",),
    "checkpoint": ("truncate", "corrupt", "delete"),
    "resume": ("stale_view",),
}


ALLOCATE_CHUNK_MB = 32
RECORD_DELAY_S = 2.0  # the ``delay`` fault of the ``record`` phase
_HELD: list[Any] = []  # what an ``allocate`` fault holds for the rest of the process


def allocate(mb: int) -> None:
    """Allocate and touch ``mb`` MB of MLX memory, a chunk at a time (a runaway, not one jump),
    and keep it."""
    import mlx.core as mx

    for _ in range(max(1, mb // ALLOCATE_CHUNK_MB)):
        chunk = mx.ones((ALLOCATE_CHUNK_MB * 1024 * 1024,), dtype=mx.uint8)
        mx.eval(chunk)
        _HELD.append(chunk)
        time.sleep(0.01)


def inject(f: FaultSpec) -> None:
    if f.action == "allocate":
        allocate(f.mb)
    if f.action == "raise":
        raise RuntimeError(f"injected fault in phase {f.phase} at step {f.step}")
    if f.action == "exit":
        os._exit(f.code)
    if f.action == "exit0":
        os._exit(0)
    if f.action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if f.action == "segfault":
        faulthandler.disable()
        import ctypes

        ctypes.string_at(0)
    if f.action == "hang":
        while True:
            time.sleep(3600)
