"""Port leases: blocks never overlap, even when many processes lease at the same moment."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

from harness.controller.ports import lease_dir, lease_ports


def _lease_and_hold(q, barrier) -> None:  # noqa: ANN001
    barrier.wait()
    lease = lease_ports(5)
    q.put((os.getpid(), lease.start, lease.count))
    barrier.wait()  # hold every lease until all have been granted
    lease.release()


def test_concurrent_leases_are_disjoint() -> None:
    n = 8
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(n)
    procs = [ctx.Process(target=_lease_and_hold, args=(q, barrier)) for _ in range(n)]
    for p in procs:
        p.start()
    got = [q.get(timeout=60) for _ in range(n)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    spans = sorted((s, s + c) for _, s, c in got)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))


def test_release_removes_lease_and_ports_are_bindable() -> None:
    with lease_ports(3) as lease:
        assert lease.file.exists()
        for port in lease.ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
    assert not lease.file.exists()


def test_stale_lease_of_dead_process_is_reclaimed() -> None:
    stale = lease_dir() / "lease-20001-4-999999999"
    stale.touch()
    lease_ports(2).release()
    assert not stale.exists()
