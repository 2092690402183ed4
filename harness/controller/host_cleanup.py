"""How a cluster host's agent (``host_agent``) finds and ends what a run left on its host: the
processes a pidfile names (never one that took a reused pid), those working in the run's
directory, mlx.launch's pidfiles, and an earlier agent of the run."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import psutil

POLL_S = 0.05


def process_of(pidfile: Path) -> psutil.Process | None:
    """The process ``pidfile`` names, if it started before the file was last written (a pid
    reused by a later process is not the one the file meant); ``None`` if gone or unreadable."""
    try:
        written = pidfile.stat().st_mtime
        p = psutil.Process(int(pidfile.read_text().strip()))
        return p if p.create_time() <= written + 1.0 else None
    except (OSError, ValueError, psutil.Error):
        return None


def _mount_namespace(pid: int | str) -> int | None:
    """The process's mount namespace (Linux), so that hosts that share a kernel but not a
    filesystem (containers, simulated hosts) never judge each other's paths; ``None`` elsewhere."""
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino
    except OSError:
        return None


def working_in(run_dir: str) -> list[psutil.Process]:
    """Processes other than this one whose working directory is in ``run_dir`` (resolved), in
    this process's mount namespace: the ranks' shells and what a rank started."""
    mine = _mount_namespace("self")
    found = []
    for p in psutil.process_iter(["cwd"]):
        cwd = (p.info.get("cwd") or "").removesuffix(" (deleted)")  # Linux, once it is removed
        if p.pid == os.getpid() or not (cwd == run_dir or cwd.startswith(run_dir + os.sep)):
            continue
        if mine is None or _mount_namespace(p.pid) == mine:
            found.append(p)
    return found


def running(p: psutil.Process) -> bool:
    """Whether the process is still the one it was and has not ended (a zombie, one whose parent
    has yet to reap it, has ended all the same)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_ended(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until each process has ended (``running``); those still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if running(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(POLL_S)


def end_agent(pidfile: Path, module: str, timeout: float) -> None:
    """Kill the agent ``pidfile`` names (silent, stopped or hung) and wait until it is reaped (its
    port lease is stale only then); a process that is not that agent is left alone."""
    p = process_of(pidfile)
    with contextlib.suppress(psutil.Error):
        if p is not None and p.pid != os.getpid() and module in " ".join(p.cmdline()):
            p.kill()
            p.wait(timeout)


def launcher_files(pids_dir: Path) -> list[Path]:
    """mlx.launch's pidfiles for the run's ranks on this host: it makes one per rank with
    ``mktemp`` in the login shell's temporary directory (the agent's, as both come over SSH)
    holding the pid of the shell that became the rank's (``pids_dir/shell<rank>``), and
    removes it only when it kills."""
    shells = set()
    for f in pids_dir.glob("shell*"):
        with contextlib.suppress(OSError):
            shells.add(f.read_text().strip())
    tmp = Path(os.environ.get("TMPDIR") or "/tmp")
    found: list[Path] = []
    for f in tmp.glob("tmp.*"):
        with contextlib.suppress(OSError):
            if f.is_file() and f.stat().st_size < 32 and f.read_text().strip() in shells:
                found.append(f)
    return found


def kill_all(procs: list[Any], timeout: float) -> list[int]:
    """SIGKILL each process (once, whatever list it came from); the pids still running after
    ``timeout``."""
    live = []
    for p in {p.pid: p for p in procs}.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
            live.append(p)
    return [p.pid for p in wait_ended(live, timeout)]
