"""The controller's side of a run across hosts: one agent per host (``host_agent``), over SSH.

Nothing assumes a shared filesystem. Each host keeps the run in a directory of its own,
``<workdir>/mlx-ddp-harness-<token>`` (the same path on every host, so one launcher command
serves them all), under which every local path the job names is mirrored
(``.../m/<local path>``): the job file is written there with its paths rewritten, input files
the host lacks (or holds with other content) are shipped, and what the ranks write under the
run's directory and the scenario's workspace comes back, as it grows, to the same local paths.
So the watchdog, collection and judgement read the same protocol files they read for a local
run. The agents report each rank's process state and RSS, signal ranks for stack dumps, and at
the end kill what is left and remove the host's directory and port lease.
"""

from __future__ import annotations

import base64
import itertools
import json
import queue
import random
import secrets
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.cluster_spec import LOCAL, Cluster, ClusterError, ClusterHost
from harness.controller.host_agent import sha256_of

AGENT = "harness.controller.host_agent"
REPLY_TIMEOUT_S = 60.0
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3")
PORT_TRIES = 20
SHIP_CHUNK = 4 << 20
MAX_SHIP_FILES = 10_000


def agent_command(host: ClusterHost, python: str) -> list[str]:
    """How the controller starts the agent on ``host`` (no SSH for mlx.launch's local name)."""
    cmd = [python, "-m", AGENT]
    return cmd if host.ssh == LOCAL else ["ssh", *SSH_OPTIONS, host.ssh, " ".join(cmd)]


@dataclass
class RankState:
    pid: int | None = None
    alive: bool = False
    rss: int | None = None


class HostLink:
    """One agent: requests and replies, and the files and process states it streams."""

    def __init__(self, index: int, host: ClusterHost, python: str, allowed: list[Path] | None = None):
        self.index, self.host = index, host
        self.root: str = ""  # the run's directory on the host
        self.allowed = allowed or []  # local directories that files from the host may be written under
        self.proc = subprocess.Popen(agent_command(host, python), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self._ids = itertools.count(1)
        self._replies: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self.ranks: dict[int, RankState] = {}
        self.procs_at = 0.0  # when the last process report came
        self.memory_bytes = 0  # the host's memory, as its agent said
        self.closed = threading.Event()
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
        if self.proc.stderr is not None:
            self.error = self.proc.stderr.read().decode(errors="replace").strip()
        self.closed.set()
        for q in self._replies.values():
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
        except (BrokenPipeError, OSError, queue.Empty):
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
            if self.proc.poll() is None:
                reply = self.request("finish", timeout=timeout)
            else:
                last = self._last_error()
                self.unanswered = f"it had ended with exit code {self.proc.returncode}" + (f" ({last})" if last else "")
        except ClusterError:
            last = self._last_error()
            self.unanswered = f"no answer to 'finish' within {timeout:g} s" + (f" ({last})" if last else "")
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)
        return reply


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _strings(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return []


def _rewrite(obj: Any, mapping: dict[str, str]) -> Any:
    if isinstance(obj, str):
        for local, remote in mapping.items():
            if obj == local or obj.startswith(local + "/"):
                return remote + obj[len(local):]
        return obj
    if isinstance(obj, dict):
        return {k: _rewrite(v, mapping) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rewrite(v, mapping) for v in obj]
    return obj


def _under(path: Path, dirs: list[Path]) -> bool:
    return any(d == path or d in path.parents for d in dirs)


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


@dataclass
class RemoteRanks:
    """The hosts of one run: placement, agents and their reports."""

    cluster: Cluster
    placement: list[int]  # rank -> host index
    links: dict[int, HostLink] = field(default_factory=dict)
    finished: dict[str, Any] = field(default_factory=dict)

    def host_of(self, rank: int) -> str:
        return self.cluster.hosts[self.placement[rank]].ssh

    def link_of(self, rank: int) -> HostLink:
        return self.links[self.placement[rank]]

    def start_agents(self, run_dir: Path, sync_dirs: list[Path]) -> None:
        token = secrets.token_hex(4)
        for h in sorted(set(self.placement)):
            link = HostLink(h, self.cluster.hosts[h], self.cluster.python, [run_dir, *sync_dirs])
            link.root = f"{self.cluster.workdir.rstrip('/')}/mlx-ddp-harness-{token}"
            self.links[h] = link
        for link in self.links.values():
            hello = link.request("hello")
            if "harness" not in hello:
                raise ClusterError(f"host {link.name}: {hello.get('error', 'no answer to hello')}")
            link.memory_bytes = int(hello.get("memory_bytes") or 0)
            made = link.request("setup", root=link.root)
            if not made.get("ok"):
                shared = " (hosts that share a filesystem need workdirs of their own)" if "exists" in str(
                    made.get("error")) else ""
                raise ClusterError(f"host {link.name}: cannot make {link.root}: {made.get('error')}{shared}")

    def ring_yield(self, backend: str) -> str | None:
        """Each host's agent links the yielding library where the ranks placed on its host fill
        its cores, or on every host under ``on`` (``ring_yield.plan`` there); the run's note names
        the hosts that did."""
        from harness.controller import ring_yield

        setting, said = ring_yield.mode(), {}
        for h, link in self.links.items():
            why = link.request("ring_yield", ranks=self.placement.count(h), backend=backend,
                               setting=setting, world_size=len(self.placement)).get("why")
            if why:
                said.setdefault(why, []).append(link.name)
        return "; ".join(f"on {', '.join(hosts)}: {why}" for why, hosts in said.items()) or None

    def lease_ports(self, count: int, rng: random.Random | None = None) -> int:
        """A block of ``count`` ports free on every host, leased by each host's agent."""
        from harness.controller.ports import HIGH, LOW

        rng = rng or random.Random()
        for _ in range(PORT_TRIES):
            start = rng.randrange(LOW, HIGH - count)
            replies = {h: link.request("lease", ports=[start, count], ips=link.host.ips)
                       for h, link in self.links.items()}
            for h, r in replies.items():
                if r.get("fatal"):
                    raise ClusterError(f"host {self.links[h].name}: {r.get('error')}")
            if all(r.get("ok") for r in replies.values()):
                return start
        raise ClusterError(f"no block of {count} ports free on every host after {PORT_TRIES} tries")

    def ship(self, job: dict[str, Any], run_dir: Path, sync_dirs: list[Path]) -> dict[int, dict[str, Any]]:
        """Send each host what the job needs; return each host's job with its paths rewritten."""
        jobs = {}
        named = {Path(s) for s in _strings(job) if s.startswith("/") and Path(s).exists()}
        # a directory above the run's own (a bare "/tmp") is no input to ship
        named = {p for p in named if not any(p in d.parents for d in [run_dir, *sync_dirs])}
        for p in named:
            if p.is_dir() and not _under(p, [run_dir, *sync_dirs]) and len(_files(p)) > MAX_SHIP_FILES:
                raise ClusterError(f"{p}: the job names a directory of more than {MAX_SHIP_FILES} files; "
                                   f"put it on every host at the same path instead of shipping it")
        for h, link in self.links.items():
            mapping = {str(run_dir): link.remote(run_dir)}
            mapping.update({str(d): link.remote(d) for d in sync_dirs})
            ship: list[Path] = []
            inputs = sorted(p for p in named if not _under(p, [run_dir, *sync_dirs]))
            for p in inputs:
                files = _files(p)
                have = link.request("have", paths=[str(f) for f in files])["sha256"]
                if have != [sha256_of(f) for f in files]:
                    ship += files
                    mapping[str(p)] = link.remote(p)
            ship += [f for p in named if _under(p, sync_dirs) for f in _files(p)]
            for f in sorted(set(ship)):
                link.put(f, f.read_bytes())
            link.request("mkdir", paths=[link.relative(run_dir / "tmp"), *map(link.relative, sync_dirs)])
            jobs[h] = _rewrite(job, dict(sorted(mapping.items(), key=lambda kv: -len(kv[0]))))
        return jobs

    def watch(self, run_dir: Path, sync_dirs: list[Path]) -> None:
        for link in self.links.values():
            link.request("watch", dirs=[link.relative(d) for d in [run_dir, *sync_dirs]])

    # what the watchdog asks ---------------------------------------------------------------
    def state(self, rank: int) -> RankState | None:
        return self.link_of(rank).ranks.get(rank)

    def groups(self) -> list[tuple[list[int], float, str]]:
        """Each host's ranks, its memory in MB (infinite: unknown) and its name."""
        return [([r for r, x in enumerate(self.placement) if x == h], link.memory_bytes / (1 << 20) or float("inf"),
                 link.name)
                for h, link in self.links.items()]

    def ended(self, rank: int) -> bool:
        """The rank's process was seen and is gone (its files up to then have come back)."""
        s = self.state(rank)
        return s is not None and not s.alive

    def rss(self, rank: int) -> int | None:
        s = self.state(rank)
        return s.rss if s is not None and s.alive else None

    def signal(self, ranks: list[int], sig: str) -> list[int]:
        sent: list[int] = []
        for h, link in self.links.items():
            mine = [r for r in ranks if self.placement[r] == h]
            if mine and link.proc.poll() is None:
                try:
                    sent += link.request("signal", ranks=mine, sig=sig, timeout=5).get("sent", [])
                except ClusterError:
                    continue
        return sent

    def unreachable(self, timeout: float = 1.0) -> list[str]:
        """``host A cannot reach B's address (why)`` for each pair of hosts whose link fails a TCP
        connection now (a refused connection reaches its host)."""
        found: list[str] = []
        threads = []

        def ask(link: HostLink) -> None:
            others = [a for h, other in self.links.items() if other is not link for a in other.host.ips]
            try:
                reach = link.request("reach", addrs=others, timeout=timeout + 5).get("reach", {})
            except ClusterError:
                found.append(f"host {link.name}'s agent does not answer")
                return
            found.extend(f"host {link.name} cannot reach {addr} ({why})" for addr, why in reach.items() if why)

        for link in self.links.values():
            threads.append(threading.Thread(target=ask, args=(link,)))
            threads[-1].start()
        for t in threads:
            t.join()
        return sorted(found)

    def finish(self) -> list[str]:
        """Stop every agent: its ranks killed, last files back, its directory removed; survivors
        as ``host:pid`` (and hosts whose directory could not be removed)."""
        left: list[str] = []
        threads = []

        def close(link: HostLink) -> None:
            self.finished[link.name] = link.close()

        for link in self.links.values():
            t = threading.Thread(target=close, args=(link,))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        for link in self.links.values():
            name, reply = link.name, self.finished.get(link.name)
            if not reply:
                why = f": {link.unanswered}" if link.unanswered else ""
                left.append(f"{name}:unknown (its agent did not answer{why})")
                continue
            left += [f"{name}:{pid}" for pid in reply.get("survivors", [])]
            if not reply.get("removed", True):
                left.append(f"{name}:files")
        return left
