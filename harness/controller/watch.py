"""Watch a started run until it ends, hangs or overruns; then make sure nothing of it survives.

Progress is any growth of a rank's event file (ranks write one event per step and one per
phase). On the wall-clock or no-progress limit, or when a rank has failed and its peers have not
ended within a grace period, the ranks' Python stacks are dumped (SIGUSR1, which every rank
registers with faulthandler) and the whole process group is killed.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

import psutil

from harness import schema
from harness.controller.cpu_use import CpuMeter, CpuUse
from harness.controller.launch import Launch
from harness.controller.progress import ProgressFeed

POLL_S = 0.1
STACK_DUMP_WAIT_S = 1.5
PEER_GRACE_S = 10.0


@dataclass
class WatchReport:
    """How a run ended, seen from outside."""

    wall_s: float
    returncode: int | None
    limit: str | None = None  # "wall" or "no_progress" when the watchdog stopped it
    limit_detail: str = ""
    stacks_dumped: bool = False
    survivors: list[int] = field(default_factory=list)
    rank_pids: dict[int, int] = field(default_factory=dict)
    exited_early: list[int] = field(default_factory=list)  # gone without a result before a limit fired
    cpu: CpuUse | None = None  # what the machine's CPUs did meanwhile


def _rank_pids(launch: Launch) -> dict[int, int]:
    """rank -> pid, from each rank's first event (``start``)."""
    pids = {}
    for r in range(launch.world_size):
        try:
            first = next(schema.read_events(schema.events_path(launch.run_dir, r)), None)
        except schema.SchemaError:
            first = None
        if first and first.get("kind") == "start":
            pids[r] = int(first["pid"])
    return pids


def _progress_mark(launch: Launch) -> tuple[int, ...]:
    marks = []
    for r in range(launch.world_size):
        try:
            marks.append(schema.events_path(launch.run_dir, r).stat().st_size)
        except FileNotFoundError:
            marks.append(-1)
    return tuple(marks)


def _exited_early(launch: Launch, pids: dict[int, int]) -> list[int]:
    """Ranks whose process is gone without having written a result."""
    return [r for r in range(launch.world_size)
            if not schema.result_path(launch.run_dir, r).exists() and r in pids and not _alive(pids[r])]


def _rank_failed(launch: Launch, pids: dict[int, int]) -> bool:
    """A rank wrote an error result, or its process is gone without a result."""
    for r in range(launch.world_size):
        res = schema.result_path(launch.run_dir, r)
        if res.exists():
            try:
                if schema.read_json(res).get("status") != "ok":
                    return True
            except schema.SchemaError:
                return True
    return bool(_exited_early(launch, pids))


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
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


def dump_stacks(pids: dict[int, int]) -> bool:
    """Ask each live rank to write its Python stacks to its stderr file."""
    sent = False
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGUSR1)
            sent = True
        except ProcessLookupError:
            pass
    if sent:
        time.sleep(STACK_DUMP_WAIT_S)
    return sent


def kill_group(launch: Launch, timeout: float = 10.0) -> list[int]:
    """SIGKILL the run's process group and wait for it to empty; return any survivors."""
    try:
        os.killpg(launch.pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        launch.proc.wait(timeout=timeout)
    except Exception:
        pass
    deadline = time.monotonic() + timeout
    while True:
        left = group_members(launch.pgid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(POLL_S)


def watch(launch: Launch, wall_s: float, no_progress_s: float, meter: CpuMeter,
          feed: ProgressFeed | None = None) -> WatchReport:
    """Block until the run ends or a limit fires; always leaves the process group empty. ``meter``
    (started before the launch) measures the CPUs meanwhile; ``feed`` is told of each poll."""
    t0 = time.monotonic()
    last_mark, last_progress = _progress_mark(launch), t0
    failed_since: float | None = None
    pids: dict[int, int] = {}
    report = WatchReport(wall_s=0.0, returncode=None)
    while launch.proc.poll() is None:
        time.sleep(POLL_S)
        now = time.monotonic()
        mark = _progress_mark(launch)
        if feed is not None:
            feed.poll(mark != last_mark)
        if mark != last_mark:
            last_mark, last_progress = mark, now
            if len(pids) < launch.world_size:  # each rank announces its pid once, in its first event
                pids = _rank_pids(launch)
        if failed_since is None and _rank_failed(launch, pids):
            failed_since = now
        if now - t0 > wall_s:
            report.limit, report.limit_detail = "wall", f"wall-clock limit of {wall_s:g} s exceeded"
        elif now - last_progress > no_progress_s:
            report.limit = "no_progress"
            report.limit_detail = f"no progress from any rank for {no_progress_s:g} s"
        elif failed_since is not None and now - failed_since > PEER_GRACE_S:
            report.limit = "peer_failed"
            report.limit_detail = f"ranks still running {PEER_GRACE_S:g} s after a rank failed"
        if report.limit:
            report.exited_early = _exited_early(launch, _rank_pids(launch))
            report.stacks_dumped = dump_stacks(_rank_pids(launch))
            break
    report.returncode = launch.proc.poll()
    report.rank_pids = _rank_pids(launch)
    report.survivors = kill_group(launch)
    if report.returncode is None:
        report.returncode = launch.proc.returncode
    report.wall_s = time.monotonic() - t0
    report.cpu = meter.stop()
    return report
