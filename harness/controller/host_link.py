"""One SSH link to a cluster host's agent (``host_agent``): JSON-line requests and replies, and
the files and process states the agent streams back (``remote`` runs a run's hosts through these).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import queue
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cluster_spec import LOCAL, ClusterError, ClusterHost
from harness.controller.host_agent import AGENT_MODULE

REPLY_TIMEOUT_S = 60.0
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3")
SHIP_CHUNK = 4 << 20


def agent_command(host: ClusterHost, python: str, ssh_options: tuple[str, ...] = ()) -> list[str]:
    """How the controller starts the agent on ``host`` (no SSH for mlx.launch's local name)."""
    cmd = [python, "-m", AGENT_MODULE]
    return cmd if host.ssh == LOCAL else ["ssh", *SSH_OPTIONS, *ssh_options, host.ssh, " ".join(cmd)]


@dataclass
class RankState:
    pid: int | None = None
    alive: bool = False
    rss: int | None = None


class HostLink:
    """One agent: requests and replies, and the files and process states it streams."""

    def __init__(self, index: int, host: ClusterHost, python: str, allowed: list[Path] | None = None,
                 ssh_options: tuple[str, ...] = ()):
        self.index, self.host = index, host
        self.root: str = ""  # the run's directory on the host, once its agent made it
        self.allowed = allowed or []  # local directories that files from the host may be written under
        self.received: dict[Path, int] = {}  # local file -> its size as the agent's messages left it
        self.proc = subprocess.Popen(agent_command(host, python, ssh_options), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self._ids = itertools.count(1)
        self._replies: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self.ranks: dict[int, RankState] = {}
        self.procs_at = 0.0  # when the last process report came
        self.memory_bytes = 0  # the host's memory, as its agent said
        self.closed = threading.Event()
        self.started_at = time.monotonic()
        self.closed_at = 0.0  # when its output ended (monotonic)
        self.error = ""
        self.unanswered = ""  # why ``close`` got no answer (``RemoteRanks.finish``)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def name(self) -> str:
        return self.host.ssh

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("op") == "file":
                self._write_file(msg)
            elif msg.get("op") == "procs":
                self.ranks = {int(r): RankState(v.get("pid"), bool(v.get("alive")), v.get("rss"))
                              for r, v in msg["ranks"].items()}
                self.procs_at = time.monotonic()
            elif msg.get("id") in self._replies:
                self._replies[msg["id"]].put(msg)
        self.closed_at = time.monotonic()
        if self.proc.stderr is not None:
            self.error = self.proc.stderr.read().decode(errors="replace").strip()
        self.closed.set()
        for q in list(self._replies.values()):
            q.put(None)

    def _write_file(self, msg: dict[str, Any]) -> None:
        rel = msg["path"]
        if not rel.startswith("m/"):
            return
        local = Path("/" + rel[2:])
        if not any(d == local or d in local.parents for d in self.allowed):
            return  # only the run's own directories come back
        local.parent.mkdir(parents=True, exist_ok=True)
        data = base64.b64decode(msg["data"])
        with open(local, "r+b" if msg["offset"] and local.exists() else "wb") as f:
            f.seek(msg["offset"])
            f.write(data)
            f.truncate()
        self.received[local] = msg["offset"] + len(data)

    def request(self, op: str, timeout: float = REPLY_TIMEOUT_S, **fields: Any) -> dict[str, Any]:
        rid = next(self._ids)
        q: queue.Queue = queue.Queue()
        self._replies[rid] = q
        try:
            with self._lock:
                assert self.proc.stdin is not None
                self.proc.stdin.write((json.dumps({"op": op, "id": rid, **fields}) + "\n").encode())
                self.proc.stdin.flush()
            reply = q.get(timeout=timeout) if not self.closed.is_set() else None
        except (OSError, ValueError, queue.Empty):  # ValueError: its input already closed (``end``)
            reply = None
        finally:
            self._replies.pop(rid, None)
        if reply is None:
            raise ClusterError(f"host {self.name}: its agent did not answer {op!r}"
                               + (f" ({self._last_error()})" if self._last_error() else ""))
        return reply

    def _last_error(self) -> str:
        if self.proc.poll() is not None:
            self.closed.wait(0.5)  # its stderr, read to the end
        return self.error.splitlines()[-1] if self.error else ""

    def relative(self, local: Path | str) -> str:
        """Where a local path is mirrored on the host, inside the run's directory there."""
        return f"m{Path(local)}"

    def remote(self, local: Path | str) -> str:
        """Where a local path is mirrored on the host."""
        return f"{self.root}/{self.relative(local)}"

    def put(self, local: Path, data: bytes) -> None:
        """Write ``data`` at ``local``'s place on the host, in chunks."""
        for offset in range(0, max(len(data), 1), SHIP_CHUNK):
            r = self.request("put", path=self.relative(local), offset=offset,
                             data=base64.b64encode(data[offset:offset + SHIP_CHUNK]).decode())
            if not r.get("ok"):
                raise ClusterError(f"host {self.name}: could not write {local}: {r.get('error')}")

    def close(self, timeout: float = 30.0) -> dict[str, Any]:
        """Finish the agent (kill its ranks, last files, remove the host's directory); where it
        gives no answer, ``unanswered`` says what is known of why."""
        reply: dict[str, Any] = {}
        try:
            if self.proc.poll() is None and not self.closed.is_set():
                reply = self.request("finish", timeout=timeout)
        except ClusterError:
            pass
        if not reply:
            self.unanswered = self._why_silent(timeout)
        self.end(5.0 if reply else 0.5)  # one that gave no answer is not waited for again
        return reply

    def end(self, wait_s: float = 5.0) -> None:
        """End the link without asking anything more (its agent finishes on its input's end);
        kill the SSH client (or local agent) that has not ended ``wait_s`` after."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)

    def _why_silent(self, timeout: float) -> str:
        """Why a request to finish got no answer: the link had closed (when, the exit code of the
        SSH client or agent, its last stderr line), or the agent stayed silent."""
        if not self.closed.wait(5.0 if self.proc.poll() is not None else 0.5):  # its stderr read to the end
            return f"no answer to 'finish' within {timeout:g} s"
        try:
            code = self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        last = self._last_error()
        ended = f"it had ended with exit code {code}" if code is not None else "its output had ended"
        return (f"{ended}, {self.closed_at - self.started_at:.1f} s after it started"
                + (f" ({last})" if last else ""))
