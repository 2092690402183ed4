"""Blocks of free consecutive TCP ports, leased so concurrent launches never share one.

MLX's ring backend binds with SO_REUSEPORT and never checks that its ports are free: two jobs
on the same ports bind without error and silently exchange data. A probe alone is not enough
(two controllers can probe the same free block at the same moment), so every lease is recorded
in a directory shared by all controllers on the machine, under an exclusive file lock. A lease
whose owner process is gone is reclaimed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LOW, HIGH = 20000, 32000  # below Linux's ephemeral range (32768+), where outgoing sockets land


class PortError(RuntimeError):
    """No free block of ports could be leased."""


def _network_namespace() -> str:
    """Ports belong to a network namespace: on Linux, processes in different ones (containers,
    simulated hosts) never share a port, so their leases are kept apart."""
    try:
        return f"-net{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""


def lease_dir() -> Path:
    """One directory per user and machine (network namespace), whatever TMPDIR a controller runs
    with."""
    base = Path("/tmp") if Path("/tmp").is_dir() else Path(tempfile.gettempdir())
    name = f"mlx-ddp-harness-ports-{os.getuid()}{_network_namespace()}"
    d = Path(os.environ.get("MLX_DDP_HARNESS_PORT_DIR") or base / name)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


@dataclass
class PortLease:
    """Ports ``start .. start+count-1``, held until ``release``."""

    start: int
    count: int
    file: Path

    @property
    def ports(self) -> range:
        return range(self.start, self.start + self.count)

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.file.unlink()

    def __enter__(self) -> PortLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _active_leases(d: Path) -> list[tuple[int, int]]:
    """(start, end) of leases whose owner is alive; stale lease files are removed."""
    active = []
    for f in d.glob("lease-*"):
        try:
            _, start, count, pid = f.name.split("-")
            start_i, count_i, pid_i = int(start), int(count), int(pid)
        except ValueError:
            continue
        if _pid_alive(pid_i):
            active.append((start_i, start_i + count_i))
        else:
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
    return active


@contextlib.contextmanager
def _locked() -> Iterator[Path]:
    """The lease directory, under its exclusive lock. A directory removed while this process
    waited for the lock (``drop_idle_lease_dir``) is made again."""
    while True:
        d = lease_dir()
        try:
            lock = open(d / ".lock", "a")
        except FileNotFoundError:  # removed between making and opening it
            continue
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                try:
                    current = os.stat(d / ".lock")
                except FileNotFoundError:
                    continue
                if not os.path.samestat(os.fstat(lock.fileno()), current):
                    continue
                yield d
                return
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def drop_idle_lease_dir() -> bool:
    """Remove this machine's lease directory when no live process holds a lease in it (what a
    cluster host's agent does last, so that nothing of a run stays on the host)."""
    with _locked() as d:
        if _active_leases(d):
            return False
        with contextlib.suppress(OSError):
            (d / ".lock").unlink()
            d.rmdir()
            return True
    return False


def _bindable(port: int, ip: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def lease_ports(count: int, attempts: int = 200, rng: random.Random | None = None) -> PortLease:
    """Lease ``count`` free consecutive ports on 127.0.0.1 for this process."""
    if count < 1:
        raise ValueError("count must be >= 1")
    rng = rng or random.Random()
    with _locked() as d:
        taken = _active_leases(d)
        for _ in range(attempts):
            start = rng.randrange(LOW, HIGH - count)
            end = start + count
            if any(start < e and s < end for s, e in taken):
                continue
            if all(_bindable(p) for p in range(start, end)):
                f = d / f"lease-{start}-{count}-{os.getpid()}"
                f.touch()
                return PortLease(start, count, f)
    raise PortError(f"no block of {count} free ports in {LOW}-{HIGH} after {attempts} tries")


def lease_block(start: int, count: int, ips: list[str] | None = None) -> PortLease | None:
    """Lease exactly ports ``start .. start+count-1`` (free on 127.0.0.1 and on each of ``ips``),
    or ``None`` when another lease or a socket holds one of them (``OSError``: an address
    that cannot be bound at all): how a cluster host's agent
    takes the block the controller proposes."""
    end = start + count
    with _locked() as d:
        if any(start < e and s < end for s, e in _active_leases(d)):
            return None
        for ip in ["127.0.0.1", *(ips or [])]:
            try:
                if not all(_bindable(p, ip) for p in range(start, end)):
                    return None
            except OSError as e:  # e.g. an address this host does not have: its ranks could not bind
                raise OSError(f"cannot bind {ip}:{start} here ({e.strerror or e})") from e
        f = d / f"lease-{start}-{count}-{os.getpid()}"
        f.touch()
        return PortLease(start, count, f)
