"""Warm rank starts: a process that has imported what one kind of rank imports (the rank runtime,
MLX, the job's trainer and the libraries it loads on every run) and forks a rank for each request,
so a rank begins where its imports would have ended. Linux CPU ranks only (a fork after a GPU
runtime started is unsafe); the controller decides (``harness.controller.warm_ranks``).

``python -m harness.rank.warm DIR KEY`` detaches, preloads from ``DIR/KEY.job.json`` and serves
on ``DIR/KEY.sock`` until idle for ``IDLE_S`` with no rank left. A request comes from
``warm_client.py`` (what mlx.launch runs in place of ``python -m harness.rank``): the rank's
argument, environment and working directory, with its stdin, stdout and stderr. The server
answers the rank's pid, and its wait status once it ends, and kills it when the client goes
(so killing the client kills the rank). A rank dies with the server (``PR_SET_PDEATHSIG``).
The client writes its rank's resource use to ``schema.warm_rusage_path``: the rank is not the
launcher's child, so the controller's own CPU figure adds it from there.

Only stdlib is imported at module level: the detaching parent must start fast."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

IDLE_S = 600.0  # a server with no rank and no request this long exits (a test session ends its own)
HEADER = struct.Struct("!I")  # the request's length, sent with the three file descriptors
PR_SET_PDEATHSIG = 1
LOCK_TRIES = 100  # 5 ms apart: half a second for a launch's moment of holding the lock to pass


def preload(job_file: Path) -> None:
    """Import what a rank of this job imports before its first step, and the modules its trainer
    imports later in a run (``entry.warm_imports``: some only on rank 0, within libraries every
    rank has loaded), and no library more: the libraries a rank reports as loaded
    (``libraries_loaded``) must be its own."""
    import harness.rank.entry as entry
    from harness import schema
    from harness.scenario.job import job_from_json

    job = job_from_json(schema.read_json(job_file))
    entry.load_libraries(job)  # marks the trainer's hidden packages absent first
    entry.job_runner(job)
    entry.warm_imports(job)


def threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the client closed before its request was read")
        out += chunk
    return out


def read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    conn.settimeout(5.0)
    msg, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
    if len(msg) != HEADER.size or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ConnectionError("a request without its header and three descriptors")
    try:
        req = json.loads(_recv_exactly(conn, HEADER.unpack(msg)[0]))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return req, fds


class Server:
    """The accept, fork and reap loop; ``serve`` returns in a forked rank (with its request)."""

    def __init__(self, directory: Path, key: str, lock_fd: int):
        self.directory, self.key, self.lock_fd, self.pid = directory, key, lock_fd, os.getpid()
        self.ranks: dict[int, tuple[socket.socket, dict[str, Any]]] = {}  # pid -> (its client, request)
        self.watched: set[socket.socket] = set()  # clients still connected

    def serve(self) -> tuple[dict[str, Any], list[int]] | None:
        from harness.schema import warm_server_path

        sock_path = warm_server_path(self.directory, self.key, "sock")
        sock_path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(sock_path))
        listener.listen(64)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        idle_since = time.monotonic()
        try:
            while True:
                timeout = None if self.ranks else max(0.0, IDLE_S - (time.monotonic() - idle_since))
                ready, _, _ = select.select([listener, wake_r, *self.watched], [], [], timeout)
                if listener in ready:
                    forked = self._accept(listener, (wake_r, wake_w))
                    if forked is not None:
                        return forked
                if wake_r in ready:
                    while True:
                        try:
                            if not os.read(wake_r, 512):
                                break
                        except BlockingIOError:
                            break
                self._reap()
                for conn in [c for c in ready if c in self.watched]:
                    self._client_gone(conn)
                if self.ranks:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since >= IDLE_S or not self.directory.is_dir():
                    return None
        finally:
            if os.getpid() == self.pid:  # not in a forked rank, which returns through here
                sock_path.unlink(missing_ok=True)

    def _accept(self, listener: socket.socket, pipe: tuple[int, int]) -> tuple[dict[str, Any], list[int]] | None:
        conn, _ = listener.accept()
        try:
            req, fds = read_request(conn)
        except (OSError, ValueError) as e:
            print(f"warm start: a request refused: {e}", flush=True)
            conn.close()
            return None
        pid = os.fork()
        if pid == 0:  # the rank: nothing of the server's stays open in it
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for s in (listener, conn, *(c for c, _ in self.ranks.values())):
                os.close(s.detach())  # detached: the socket objects must not close a reused number later
            for fd in (*pipe, self.lock_fd):
                os.close(fd)
            return req, fds
        for fd in fds:
            os.close(fd)
        self.ranks[pid] = (conn, req)
        self.watched.add(conn)
        try:
            conn.sendall(b"P" + struct.pack("!i", pid))
        except OSError:
            self._client_gone(conn)
        return None

    def _client_gone(self, conn: socket.socket) -> None:
        """A client closed (it was killed, or it ended): its rank goes with it."""
        try:
            if conn.recv(16):
                return  # nothing is expected after the request; ignore it
        except OSError:
            pass
        self.watched.discard(conn)
        for pid, (c, _) in self.ranks.items():
            if c is conn:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _reap(self) -> None:
        while self.ranks:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn, req = self.ranks.pop(pid)
            try:
                conn.sendall(b"E" + struct.pack("!i", status) + self._usage(req, usage))
            except OSError:
                pass
            self.watched.discard(conn)
            conn.close()

    @staticmethod
    def _usage(req: dict[str, Any], usage: Any) -> bytes:
        """Where and what the client writes of its rank's resource use (the client, not this
        server: the launcher's process group holds the client, so the controller never removes
        the run's directory while it writes)."""
        from harness import schema

        record = {"path": str(schema.warm_rusage_path(req["argv"][0], int(req["env"].get("MLX_RANK", "0")))),
                  "record": schema.stamp({"cpu_s": usage.ru_utime + usage.ru_stime, "maxrss_kb": usage.ru_maxrss})}
        data = json.dumps(record).encode()
        return HEADER.pack(len(data)) + data


def become_rank(req: dict[str, Any], fds: list[int]) -> int:
    """In the forked process: take the client's descriptors, environment and directory, then
    run the rank as ``python -m harness.rank`` would."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the server died before the line above
        return 1
    os.setpgid(0, 0)  # its own process group, as a launch's is: the controller kills it whole
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.path[0] = req["cwd"]
    import harness.rank.entry as entry

    sys.argv = [str(Path(entry.__file__).with_name("__main__.py")), *req["argv"]]
    if "numpy.random" in sys.modules:  # a fresh process's global state, not the server's copy
        sys.modules["numpy.random"].seed()
    return entry.main(req["argv"])


def hold_lock(directory: Path, key: str) -> int | None:
    """The key's lock, held (the descriptor), or None where another server holds it."""
    from harness.schema import warm_server_path

    lock_fd = os.open(warm_server_path(directory, key, "lock"), os.O_CREAT | os.O_RDWR, 0o600)
    # A launch asks whether a server holds the lock by taking it for a moment
    # (``warm_ranks._held``): a server that met such a moment would give up with none serving.
    for _ in range(LOCK_TRIES):
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(lock_fd, 0)  # a held lock never names an earlier server's pid
            return lock_fd
        except BlockingIOError:
            time.sleep(0.005)
    os.close(lock_fd)
    return None


def start(directory: Path, key: str, lock_fd: int) -> int:
    """Preload, then serve under the held lock; a forked rank returns from here with its code."""
    from harness.schema import warm_server_path

    preload(warm_server_path(directory, key, "job.json"))
    if threads() > 1:  # a fork keeps only the forking thread: a library started one, so no warm starts
        why = f"{threads()} threads after the imports (a fork keeps one); ranks of this key start cold"
        warm_server_path(directory, key, "refused").write_text(why + "\n")
        print(f"warm start: {why}", flush=True)
        return 0
    gc.freeze()  # the imports' objects: a rank's collections (its exit's too) skip them, untouched
    forked = Server(directory, key, lock_fd).serve()
    if forked is None:
        return 0
    return become_rank(*forked)


def main(argv: list[str]) -> int:
    directory, key = Path(argv[0]), argv[1]
    # The lock is taken before the detaching fork, and the detached server's pid written into it
    # before this parent ends: once the controller's wait for this parent is over, the lock says
    # whether a server serves or is importing (a flock belongs to the open file, shared by the fork).
    lock_fd = hold_lock(directory, key)
    if lock_fd is None:
        return 0  # another server holds this key
    pid = os.fork()
    if pid:  # detach: the controller waits only for this parent
        os.pwrite(lock_fd, str(pid).encode(), 0)
        return 0
    os.setsid()
    os.pwrite(lock_fd, str(os.getpid()).encode(), 0)  # the same pid, should the parent have died first
    return start(directory, key, lock_fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
