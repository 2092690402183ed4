"""Watch a started run until it ends, hangs or overruns; then make sure nothing of it survives.

Progress is any growth of a rank's event file (ranks write one event per step and one per
phase). The run is stopped at once when a rank is gone without a result (its peers would wait
in a collective forever: mlx.launch ends a run only when a rank exits non-zero), when a rank
passes its hard memory limit (``harness.memory.guard``), on the wall-clock or no-progress limit, or when
a rank reported a failure and its peers have not ended within a grace period. Before the kill,
the live ranks' Python stacks are dumped (SIGUSR1, which every rank registers with faulthandler)
and the whole process group is killed.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from harness import schema
from harness.controller.cpu_use import CpuMeter
from harness.controller.launch import Launch, launcher_exits
from harness.controller.outcome import WatchReport
from harness.controller.progress import EventTail, ProgressFeed
from harness.controller.rank_budget import NeighbourMeter
from harness.controller.warm_ranks import rank_cpu_s
from harness.memory.guard import MB, MemoryLimits, RankMemory

POLL_S = 0.1
STACK_DUMP_WAIT_S = 1.5  # the longest wait for the ranks' stack dumps
STACK_SETTLE_S = 0.2  # a dump is complete once its stderr file stops growing this long
PEER_GRACE_S = 10.0
GONE_GRACE_S = 0.5  # mlx.launch ends a run itself when a rank exits non-zero; this long to do so
LAUNCH_END_GRACE_S = 5.0  # every rank has ended: mlx.launch has only to exit (slower on a loaded machine)


class RankEvents:
    """What the watchdog reads from the ranks' event files as they grow: each rank's pid, last
    step and memory figures (``RankMemory.saw``)."""

    def __init__(self, launch: Launch):
        self.tails = [EventTail(schema.events_path(launch.run_dir, r)) for r in range(launch.world_size)]
        self.ranks = {r: RankMemory() for r in range(launch.world_size)}
        self.heard = {r: 0.0 for r in range(launch.world_size)}  # time.monotonic() of its last event

    def read(self) -> None:
        for r, tail in enumerate(self.tails):
            m = self.ranks[r]
            for e in tail.read():
                self.heard[r] = time.monotonic()
                m.saw(r, e)

    @property
    def pids(self) -> dict[int, int]:
        return {r: m.pid for r, m in self.ranks.items() if m.pid}


def _progress_mark(launch: Launch) -> tuple[int, ...]:
    marks = []
    for r in range(launch.world_size):
        try:
            marks.append(schema.events_path(launch.run_dir, r).stat().st_size)
        except FileNotFoundError:
            marks.append(-1)
    return tuple(marks)


def _gone(launch: Launch, pids: dict[int, int], exits: dict[int, int | None]) -> set[int]:
    """Ranks whose process is gone without having written a result (``RankProcesses.gone``)."""
    missing = [r for r in range(launch.world_size) if not schema.result_path(launch.run_dir, r).exists()]
    return launch.ranks.gone(missing, pids, exits)


def gone_stops_the_run(gone: set[int], since: float, now: float, exited_0: bool, all_ended: bool) -> bool:
    """Whether ranks gone without a result (since ``since``) stop the run now: where a peer may
    still wait for them, at once for one that exited 0 (mlx.launch ends no run for it), else after
    ``GONE_GRACE_S``; where every rank has ended nothing waits, and mlx.launch is given
    ``LAUNCH_END_GRACE_S`` to exit before the watchdog calls it a limit."""
    if not gone:
        return False
    if all_ended:
        return now - since >= LAUNCH_END_GRACE_S
    return exited_0 or now - since >= GONE_GRACE_S


def _rank_failed(launch: Launch) -> bool:
    """A rank wrote an error result."""
    for r in range(launch.world_size):
        res = schema.result_path(launch.run_dir, r)
        if res.exists():
            try:
                if schema.read_json(res).get("status") != "ok":
                    return True
            except schema.SchemaError:
                return True
    return False


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return out


def _sizes(paths: list[Path]) -> list[int]:
    return [p.stat().st_size if p.exists() else 0 for p in paths]


def dump_stacks(launch: Launch, pids: dict[int, int]) -> bool:
    """Ask each live rank to write its Python stacks to its stderr file; wait until the files
    stop growing (faulthandler writes from its signal handler, even in a blocked collective; a
    cluster host's file comes back through its agent)."""
    sent = [schema.stderr_path(launch.run_dir, r) for r in launch.ranks.signal(pids, "SIGUSR1")]
    if not sent:
        return False
    before = _sizes(sent)
    t0 = last_change = time.monotonic()
    sizes = before
    while time.monotonic() - t0 < STACK_DUMP_WAIT_S:
        time.sleep(0.05)
        now_sizes = _sizes(sent)
        if now_sizes != sizes:
            sizes, last_change = now_sizes, time.monotonic()
        elif (all(a > b for a, b in zip(sizes, before, strict=True))
              and time.monotonic() - last_change >= STACK_SETTLE_S):
            break
    return True


class ExitWait:
    """Sleeps of at most a poll that end the moment a process ends: on a pidfd where the system
    has them (Linux), else through ``Popen.wait``, so a run's end is seen at once, not at the next
    poll (a poll's wait was a tenth of a second on every launch)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.poller: select.poll | None = None
        try:
            self.fd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # macOS, an old kernel or a sandbox, or a process already reaped
            self.fd = None
        else:
            self.poller = select.poll()  # no limit on the descriptor's number, as select() has
            self.poller.register(self.fd, select.POLLIN)

    def sleep(self, seconds: float) -> None:
        if self.poller is not None:
            self.poller.poll(seconds * 1000)
            return
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd, self.poller = None, None


def kill_group(launch: Launch, pids: dict[int, int] | None = None, timeout: float = 10.0) -> list[int | str]:
    """SIGKILL the run's process group and wait for it to empty; on cluster hosts, have each
    agent kill what is left, send the last files and remove the host's directory. Return any
    survivors (``host:pid`` on a cluster host). Warm-started ranks are outside the group: they
    are killed by their pids (``pids``, else those their events name)."""
    try:
        os.killpg(launch.pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    warm: list[int] = []  # each warm rank leads a process group of its own (its children: a trainer's)
    if launch.warm:
        if pids is None:
            seen = RankEvents(launch)
            seen.read()
            pids = seen.pids
        warm = list(pids.values())
        for pid in warm:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        launch.proc.wait(timeout=timeout)
    except Exception:
        pass
    remote_left = launch.ranks.finish()
    deadline = time.monotonic() + timeout
    while True:
        left: list[int | str] = [p for g in (launch.pgid, *warm) for p in group_members(g)]
        if not left or time.monotonic() > deadline:
            return left + remote_left
        time.sleep(POLL_S)


def watch(launch: Launch, wall_s: float, no_progress_s: float, meter: CpuMeter,
          feed: ProgressFeed | None = None, memory: MemoryLimits | None = None,
          neighbours: NeighbourMeter | None = None, stop: Callable[[], None] | None = None) -> WatchReport:
    """Block until the run ends or a limit fires; always leaves the process group empty. ``meter``
    (started before the launch) measures the CPUs meanwhile, ``neighbours`` the other launches;
    ``feed`` is told of each poll; ``memory``: the hard limits enforced meanwhile (the machine's
    share alone when ``None``). The run's wall time, and its limit, count from the meter's start:
    the launch itself (and a warm-start server's imports it waited for) is part of the run.
    ``stop`` is called at each poll: what it raises leaves here as an interruption does."""
    t0 = meter.t0
    last_mark, last_progress = _progress_mark(launch), time.monotonic()
    failed_since: float | None = None
    gone_since: float | None = None
    seen = RankEvents(launch)
    memory = memory or MemoryLimits()
    machine_mb = psutil.virtual_memory().total / MB
    report = WatchReport(wall_s=0.0, returncode=None, remote=launch.ranks.remote)
    ended = ExitWait(launch.proc)
    try:
        while launch.proc.poll() is None:
            ended.sleep(POLL_S)
            if stop is not None:
                stop()
            now = time.monotonic()
            mark = _progress_mark(launch)
            if feed is not None:
                feed.poll(mark != last_mark)
            if neighbours is not None:
                neighbours.poll()
            if mark != last_mark:
                last_mark, last_progress = mark, now
                seen.read()
            exits = launcher_exits(launch.run_dir) if launch.world_size > 1 else {}
            gone = _gone(launch, seen.pids, exits)
            if gone and gone_since is None:
                gone_since = now
            if failed_since is None and _rank_failed(launch):
                failed_since = now
            over = launch.ranks.over_memory(seen.ranks, memory, machine_mb)
            exited_0 = any(exits.get(r) == 0 for r in gone)  # mlx.launch will not end the run for these
            all_ended = bool(gone) and len(seen.pids) == launch.world_size and not any(
                launch.ranks.running(r, pid) for r, pid in seen.pids.items())
            if gone_since is not None and gone_stops_the_run(gone, gone_since, now, exited_0, all_ended):
                report.limit = "rank_gone"
                ranks = f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, sorted(gone)))} gone without a result"
                report.limit_detail = (f"{ranks}, and mlx.launch still running {LAUNCH_END_GRACE_S:g} s after every "
                                       f"rank ended" if all_ended else f"{ranks}, the others stopped at once")
            elif over:
                report.limit, report.limit_detail = "memory", over
            elif now - t0 > wall_s:
                report.limit, report.limit_detail = "wall", f"wall-clock limit of {wall_s:g} s exceeded"
            elif now - last_progress > no_progress_s:
                report.limit = "no_progress"
                steps = {r: m.step for r, m in seen.ranks.items()}
                report.limit_detail = (f"no progress from any rank for {no_progress_s:g} s"
                                       + launch.ranks.last_heard(steps, seen.heard))
            elif failed_since is not None and now - failed_since > PEER_GRACE_S:
                report.limit = "peer_failed"
                report.limit_detail = f"ranks still running {PEER_GRACE_S:g} s after a rank failed"
            if report.limit:
                seen.read()
                report.exited_early = sorted(_gone(launch, seen.pids, launcher_exits(launch.run_dir)))
                live = {r: pid for r, pid in seen.pids.items()
                        if r not in report.exited_early and launch.ranks.running(r, pid)}
                report.stacks_dumped = dump_stacks(launch, live)
                break
    finally:
        ended.close()
    report.named_at = time.time()
    report.returncode = launch.proc.poll()
    seen.read()
    report.rank_pids = seen.pids
    report.survivors = kill_group(launch, seen.pids)
    report.ended_at = time.time()
    if report.returncode is None:
        report.returncode = launch.proc.returncode
    report.wall_s = time.monotonic() - t0
    report.cpu = meter.stop(rank_cpu_s(launch.run_dir, launch.world_size) if launch.warm else 0.0)
    report.neighbours = neighbours.stop() if neighbours is not None else None
    return report
