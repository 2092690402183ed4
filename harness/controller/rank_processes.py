"""A run's rank processes as the watchdog sees them, wherever they run: ``LocalProcesses`` (this
machine: pids and the launcher's log) and ``HostProcesses`` (cluster hosts: what each host's
agent reports). The watchdog and the session never ask which one they hold."""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING, Protocol

import psutil

from harness import main_thread_signal
from harness.memory.guard import MemoryLimits, RankMemory, over_limit
from harness.schema import after_step

if TYPE_CHECKING:
    from harness.controller.remote import RemoteRanks

AGENT_SILENT_S = 5.0  # a cluster host's agent reports every tick: this long without, its link is suspect


class RankProcesses(Protocol):
    remote: bool  # the ranks' exit statuses come through a shell on their host (``launcher_exits``)

    def gone(self, missing: list[int], pids: dict[int, int], exits: dict[int, int | None]) -> set[int]:
        """Of the ranks ``missing`` a result, those whose process has ended."""

    def running(self, rank: int, pid: int) -> bool: ...

    def over_memory(self, ranks: dict[int, RankMemory], memory: MemoryLimits, machine_mb: float) -> str | None:
        """The hard memory limits, against the memory of the machine each rank runs on."""

    def last_heard(self, steps: dict[int, int], heard: dict[int, float]) -> str:
        """Where each rank stopped, for a no-progress message ("" where the ranks are local)."""

    def signal(self, pids: dict[int, int], sig: str) -> list[int]:
        """Send ``sig`` to the live ranks of ``pids``; the ranks it reached."""

    def host_of(self, rank: int) -> str | None: ...

    def finish(self) -> list[int | str]:
        """Stop what is left of the ranks' hosts' side; what survived (``host:pid``)."""

    def notes(self) -> list[str]:
        """What the run should say of where its ranks ran (a host's agent link lost, taken over)."""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class LocalProcesses:
    """Ranks on this machine, children of mlx.launch (or the one rank process)."""

    remote = False

    def gone(self, missing: list[int], pids: dict[int, int], exits: dict[int, int | None]) -> set[int]:
        return {r for r in missing if r in exits or (r in pids and not alive(pids[r]))}

    def running(self, rank: int, pid: int) -> bool:
        return alive(pid)

    def over_memory(self, ranks: dict[int, RankMemory], memory: MemoryLimits, machine_mb: float) -> str | None:
        return over_limit(ranks, memory, machine_mb)

    def last_heard(self, steps: dict[int, int], heard: dict[int, float]) -> str:
        return ""

    def signal(self, pids: dict[int, int], sig: str) -> list[int]:
        reached = []
        for r, pid in pids.items():
            try:
                main_thread_signal.send(pid, getattr(signal, sig))
                reached.append(r)
            except ProcessLookupError:
                pass
        return reached

    def host_of(self, rank: int) -> str | None:
        return None

    def finish(self) -> list[int | str]:
        return []

    def notes(self) -> list[str]:
        return []


class HostProcesses:
    """Ranks on cluster hosts: only each host's agent (``RemoteRanks``) sees them (its report of a
    rank's end comes after the files the rank wrote before it; the launcher's log may come first)."""

    remote = True

    def __init__(self, hosts: RemoteRanks):
        self.hosts = hosts

    def gone(self, missing: list[int], pids: dict[int, int], exits: dict[int, int | None]) -> set[int]:
        return {r for r in missing if self.hosts.ended(r)}

    def running(self, rank: int, pid: int) -> bool:
        return not self.hosts.ended(rank)

    def over_memory(self, ranks: dict[int, RankMemory], memory: MemoryLimits, machine_mb: float) -> str | None:
        for group, host_mb, name in self.hosts.groups():
            over = over_limit({r: ranks[r] for r in group}, memory, host_mb, self._rss, f"host {name}")
            if over:
                return over
        return None

    def _rss(self, rank: int, pid: int) -> int | None:
        return self.hosts.rss(rank)  # what the rank's host agent last reported

    def last_heard(self, steps: dict[int, int], heard: dict[int, float]) -> str:
        """Where each rank stopped: its host, its last step, how long ago, the one heard from
        least recently first; hosts whose agent went silent, and hosts that cannot reach another's
        ring address now."""
        now = time.monotonic()
        parts = [f"rank {r} on {self.hosts.host_of(r)} {after_step(steps[r])}, {now - heard[r]:.1f} s ago"
                 if heard[r] else f"rank {r} on {self.hosts.host_of(r)} never reported"
                 for r in sorted(heard, key=lambda r: heard[r])]
        silent = [f"host {link.name}'s agent silent for {now - link.procs_at:.0f} s"
                  for link in self.hosts.links.values() if link.procs_at and now - link.procs_at > AGENT_SILENT_S]
        return "; last heard: " + "; ".join(parts + silent + self.hosts.unreachable())

    def signal(self, pids: dict[int, int], sig: str) -> list[int]:
        return self.hosts.signal(sorted(pids), sig)

    def host_of(self, rank: int) -> str | None:
        return self.hosts.host_of(rank)

    def finish(self) -> list[int | str]:
        return list(self.hosts.finish())

    def notes(self) -> list[str]:
        return list(self.hosts.notes)
