"""What a run left, as the judge and the reports read it: how it ended seen from outside
(``WatchReport``, written by ``watch``), each rank's outcome and the run's (``collect``,
``session``). Plain records: nothing here launches, watches or reads files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.controller.cpu_use import CpuUse
    from harness.controller.rank_budget import Neighbours


@dataclass
class WatchReport:
    """How a run ended, seen from outside."""

    wall_s: float
    returncode: int | None
    limit: str | None = None  # why the watchdog stopped it: "rank_gone", "memory", "wall", "no_progress", "peer_failed"
    limit_detail: str = ""
    stacks_dumped: bool = False
    survivors: list[int | str] = field(default_factory=list)  # pids; "host:pid" on a cluster host
    rank_pids: dict[int, int] = field(default_factory=dict)
    exited_early: list[int] = field(default_factory=list)  # gone without a result before a limit fired
    cpu: CpuUse | None = None  # what the machine's CPUs did meanwhile
    neighbours: Neighbours | None = None  # other launches beside it
    named_at: float = 0.0  # time.time() when the watch knew the run had ended or stopped it (a limit)
    ended_at: float = 0.0  # time.time() once every process of the run was gone
    remote: bool = False  # its ranks ran on cluster hosts


@dataclass
class RankOutcome:
    rank: int
    exit_code: int | None  # None: unknown (e.g. killed by the launcher or the watchdog)
    killed: bool
    result: dict[str, Any] | None
    events: list[dict[str, Any]]
    stderr_tail: str

    @property
    def last_step(self) -> int:
        """The last step this rank finished, from its events."""
        return max((int(e.get("step") or 0) for e in self.events if e.get("kind") == "step"), default=0)

    @property
    def ok(self) -> bool:
        return (
            self.result is not None
            and self.result.get("status") == "ok"
            and self.exit_code in (0, None)
            and not self.killed
        )


@dataclass
class RunOutcome:
    """Everything the judge and the reports need from one run."""

    name: str
    world_size: int
    backend: str | None
    ok: bool
    failure: str | None
    ranks: list[RankOutcome]
    watch: WatchReport
    params: dict[str, Any] | None = None
    params_u: float | None = None  # the unit roundoff of the coarsest dtype ``params`` are stored in
    moved: float | None = None  # how far training moved rank 0's parameters, relative (``run_job.moved``)
    artifacts: Path | None = None
    notes: list[str] = field(default_factory=list)  # what happened around its ranks (``RankProcesses.notes``)
    floor: str | None = None  # a noise-floor run the harness added: what it computes
    backend_reason: str | None = None  # why the harness chose another backend than the usual one
    ring_yield: str | None = None  # its ranks yielded a core while they waited, and why (``controller.ring_yield``)
    warm_start: bool = False  # its ranks forked from a warm-start server (``controller.warm_ranks``)
    device: str | None = None  # "gpu" or "cpu": what the ranks computed on (``run_job.device_used``)
    device_reason: str | None = None  # why, where ``auto`` chose or the device check moved them
    queued_s: float = 0.0  # how long the launch waited for rank slots (``rank_budget``)
    hosts: list[str] | None = None  # rank -> the cluster host it ran on (``None``: this machine)
    collectives: dict[str, Any] | None = None  # its ranks' ledgers compared (2+ ranks; ``controller.ledgers``)

    def result(self, rank: int = 0) -> dict[str, Any]:
        res = self.ranks[rank].result
        if res is None:
            raise KeyError(f"rank {rank} of run {self.name!r} wrote no result")
        return res
