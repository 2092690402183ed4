"""What the controller learns of a cluster's hosts before a run (and ``doctor --hostfile``): each
host's agent reached over SSH (``harness.controller.remote``), its harness and MLX compared with
this controller's, and, when asked, its MLX's distributed backends."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from harness.cluster_spec import Cluster, ClusterError
from harness.controller.remote import HostLink


@dataclass
class HostCheck:
    """What preflight and ``doctor --hostfile`` learned of one host."""

    host: str
    reach_s: float | None = None  # SSH connection and agent start to its first answer
    versions: dict[str, Any] = field(default_factory=dict)
    problem: str = ""
    backends: dict[str, Any] = field(default_factory=dict)  # with ``backends=True``: its MLX's, and its device


def check_hosts(cluster: Cluster, hosts: list[int] | None = None, backends: bool = False) -> list[HostCheck]:
    """Reach each host's agent and compare its harness source, harness version and MLX with this
    controller's; each problem as one line naming the host. ``backends``: also ask each host's
    MLX for its distributed backends (it imports MLX there)."""
    from harness.controller.host_agent import versions

    mine = versions()
    checks: list[HostCheck] = []
    links: list[HostLink] = []
    try:
        for i in hosts if hosts is not None else range(len(cluster.hosts)):
            t0 = time.monotonic()
            link = HostLink(i, cluster.hosts[i], cluster.python)
            links.append(link)
            check = HostCheck(link.name)
            checks.append(check)
            try:
                check.versions = link.request("hello", timeout=30)
            except ClusterError as e:
                check.problem = str(e)
                continue
            check.reach_s = time.monotonic() - t0
            theirs = check.versions
            for key, what in (("harness", "harness version"), ("source", "harness source digest"), ("mlx", "MLX")):
                if theirs.get(key) != mine.get(key):
                    check.problem = (f"host {link.name} runs {what} {theirs.get(key)} ({theirs.get('executable')}), "
                                     f"this controller {mine.get(key)}: install the same on every host")
                    break
            if backends:
                try:
                    check.backends = link.request("backends", timeout=60)
                except ClusterError as e:
                    check.backends = {"error": str(e)}
    finally:
        for link in links:
            link.close(timeout=10)
    return checks
