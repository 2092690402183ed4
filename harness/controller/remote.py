"""The controller's side of a run across hosts: one agent per host (``host_agent``), over SSH.

Nothing assumes a shared filesystem. Each host keeps the run in a directory of its own,
``<workdir>/mlx-ddp-harness-<token>`` (the same path on every host, so one launcher command
serves them all), under which every local path the job names is mirrored
(``.../m/<local path>``): the job file is written there with its paths rewritten, input files
the host lacks (or holds with other content) are shipped, and what the ranks write under the
run's directory and the scenario's workspace comes back, as it grows, to the same local paths.
So the watchdog, collection and judgement read the same protocol files they read for a local
run. The agents report each rank's process state and RSS, signal ranks for stack dumps, and at
the end kill what is left and remove the host's directory and port lease; where one gives no
answer then, a second agent on its host takes the run over and does it (``_take_over``).
"""

from __future__ import annotations

import random
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.cluster_spec import Cluster, ClusterError
from harness.controller.host_link import HostLink, RankState
from harness.controller.host_mirror import sha256_of

PORT_TRIES = 20
TAKE_OVER_S = 30.0  # how long a second agent (``RemoteRanks._take_over``) may take to connect, adopt, finish
MAX_SHIP_FILES = 10_000


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
    watched: list[Path] = field(default_factory=list)  # local directories the agents send files back to
    finish_timeout_s: float = 30.0  # how long an agent's answer to ``finish`` is waited for
    notes: list[str] = field(default_factory=list)  # what the run should say of its hosts (a link lost)

    def host_of(self, rank: int) -> str:
        return self.cluster.hosts[self.placement[rank]].ssh

    def link_of(self, rank: int) -> HostLink:
        return self.links[self.placement[rank]]

    def start_agents(self, run_dir: Path, sync_dirs: list[Path]) -> None:
        token = secrets.token_hex(4)
        self.watched = [run_dir, *sync_dirs]
        root = f"{self.cluster.workdir.rstrip('/')}/mlx-ddp-harness-{token}"
        for h in sorted(set(self.placement)):
            self.links[h] = HostLink(h, self.cluster.hosts[h], self.cluster.python, [run_dir, *sync_dirs])
        for link in self.links.values():
            hello = link.request("hello")
            if "harness" not in hello:
                raise ClusterError(f"host {link.name}: {hello.get('error', 'no answer to hello')}")
            link.memory_bytes = int(hello.get("memory_bytes") or 0)
            made = link.request("setup", root=root)
            if not made.get("ok"):
                shared = " (hosts that share a filesystem need workdirs of their own)" if "exists" in str(
                    made.get("error")) else ""
                raise ClusterError(f"host {link.name}: cannot make {root}: {made.get('error')}{shared}")
            link.root = root

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
        as ``host:pid`` (and hosts whose directory could not be removed). Where an agent gives no
        answer (its link lost), a second agent on that host takes the run over and finishes it."""
        left: list[str] = []
        threads = []

        def close(h: int, link: HostLink) -> None:
            reply = link.close(self.finish_timeout_s)
            if not reply:
                reply = self._take_over(h, link)
            self.finished[link.name] = reply

        for h, link in self.links.items():
            t = threading.Thread(target=close, args=(h, link))
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

    def _take_over(self, h: int, lost: HostLink) -> dict[str, Any]:
        """Finish the run on ``lost``'s host through a second agent: the first ended, the files it
        did not send, the ranks and anything working in the run's directory killed, the directory
        removed. Its reply, or ``{}`` (``lost.unanswered`` then says why neither finished it)."""
        if not lost.root:
            return {}  # it never made the run's directory
        link = HostLink(h, lost.host, self.cluster.python, lost.allowed, ("-o", f"ConnectTimeout={TAKE_OVER_S:g}"))
        known = {}  # what came back before the first went silent: the second sends the rest
        for f, size in lost.received.items():
            digest = sha256_of(f, size)
            if digest is not None:
                known[link.relative(f)] = [size, digest]
        try:
            took = link.request("adopt", timeout=TAKE_OVER_S, root=lost.root,
                                dirs=[link.relative(d) for d in self.watched], known=known)
        except ClusterError as e:
            took = {"ok": False, "error": str(e)}
        if not took.get("ok"):
            link.end()
            lost.unanswered += f"; nor could a second agent take it over ({took.get('error')})"
            return {}
        reply = link.close(TAKE_OVER_S)
        if not reply:
            lost.unanswered += f"; a second agent took it over but gave no answer either ({link.unanswered})"
            return {}
        found = "it finished the run there" if took.get("found") else "the run's directory there was already gone"
        self.notes.append(f"host {lost.name}: its agent gave no answer at the end ({lost.unanswered}); a second "
                          f"agent took over and {found}")
        return reply
