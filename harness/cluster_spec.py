"""Hosts to run ranks on: a hostfile in the format ``mlx.launch`` takes, or a scenario's
``[cluster]`` section (pure data, read by the scenario layer and the controller).

A hostfile is a JSON list of hosts (``{"ssh": NAME, "ips": [ADDRESS, ...]}``), or an object
with ``"hosts"`` (and mlx.launch's ``"backend"`` and ``"envs"``). mlx.launch ignores other keys,
so the same file may carry the harness's own settings under ``"harness"``: ``python`` (the
interpreter on the hosts; default: the controller's own path) and ``workdir`` (where each host
keeps a run's files while it runs; default ``/tmp``). A host listed several times is one host.

Placement: a run of N ranks over H hosts puts ranks in blocks, the first ``N mod H`` hosts one
more (2 ranks on 2 hosts: one each; 4 ranks: ranks 0-1 on the first, 2-3 on the second); a run of
fewer ranks than hosts uses the first N. World-size-1 runs (the reference, noise floors) run on
the controller's machine, as they need no launcher.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOCAL = "127.0.0.1"  # the one ssh name mlx.launch runs without SSH


class ClusterError(ValueError):
    """A hostfile or ``[cluster]`` section that cannot be used, or a host that is not ready."""


@dataclass
class ClusterHost:
    ssh: str
    ips: list[str]


@dataclass
class Cluster:
    hosts: list[ClusterHost]
    python: str = field(default_factory=lambda: sys.executable)
    workdir: str = "/tmp"
    envs: list[str] = field(default_factory=list)
    source: str = ""

    def place(self, world_size: int) -> list[int]:
        """rank -> index of its host."""
        n = min(world_size, len(self.hosts))
        base, extra = divmod(world_size, n)
        out: list[int] = []
        for h in range(n):
            out += [h] * (base + (1 if h < extra else 0))
        return out


def _hosts(items: Any, src: str) -> list[ClusterHost]:
    if not isinstance(items, list) or not items:
        raise ClusterError(f"{src}: hosts: expected a non-empty list of {{\"ssh\": NAME, \"ips\": [ADDRESS]}}")
    out: list[ClusterHost] = []
    for i, h in enumerate(items):
        if not isinstance(h, dict) or not isinstance(h.get("ssh"), str) or not h["ssh"]:
            raise ClusterError(f"{src}: hosts[{i}]: needs \"ssh\", the name SSH reaches the host by")
        ips = h.get("ips", [])
        if not isinstance(ips, list) or not ips or not all(isinstance(a, str) and a for a in ips):
            raise ClusterError(f"{src}: hosts[{i}] ({h['ssh']}): needs \"ips\", the addresses its ranks use "
                               f"(the ring backend connects ranks by address)")
        if any(x.ssh == h["ssh"] for x in out):
            continue  # listed once per rank, as mlx.launch's own hostfiles are
        out.append(ClusterHost(h["ssh"], list(ips)))
    return out


def from_mapping(data: Any, src: str, base: Path | None = None) -> Cluster:
    """A cluster from a parsed hostfile (list or object) or ``[cluster]`` table."""
    if isinstance(data, list):
        return Cluster(_hosts(data, src), source=src)
    if not isinstance(data, dict):
        raise ClusterError(f"{src}: expected a list of hosts or an object with \"hosts\"")
    settings = dict(data.get("harness") or {})
    for key in ("python", "workdir"):
        if key in data and key not in settings:
            settings[key] = data[key]
    if "hostfile" in data:
        path = Path(data["hostfile"])
        if base is not None and not path.is_absolute():
            path = base / path
        inner = load_hostfile(path)
        hosts, envs = inner.hosts, inner.envs
        settings = {"python": inner.python, "workdir": inner.workdir, **settings}
    else:
        hosts = _hosts(data.get("hosts"), src)
        envs = data.get("envs", [])
        if not isinstance(envs, list) or not all(isinstance(e, str) and "=" in e for e in envs):
            raise ClusterError(f"{src}: envs: expected a list of \"NAME=VALUE\"")
    unknown = set(settings) - {"python", "workdir"}
    if unknown:
        raise ClusterError(f"{src}: harness.{sorted(unknown)[0]}: unknown key (known: python, workdir)")
    for key, value in settings.items():
        if not isinstance(value, str) or not value.startswith("/"):
            raise ClusterError(f"{src}: {key}: expected an absolute path, got {value!r}")
    return Cluster(hosts, envs=list(envs), source=src, **settings)


def load_hostfile(path: Path | str) -> Cluster:
    """Read a hostfile; one line naming the file and the problem otherwise."""
    p = Path(path)
    if not p.is_file():
        raise ClusterError(f"{p}: hostfile not found")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ClusterError(f"{p}: not a JSON hostfile ({e})") from e
    return from_mapping(data, str(p), p.parent)
