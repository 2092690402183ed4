"""``mlx-ddp-harness doctor``: can this machine run DDP scenarios, and fast?"""

from __future__ import annotations

import shutil
from typing import Any

from tabulate import tabulate

BACKENDS = ("ring", "nccl", "mpi", "jaccl")


def checks() -> list[tuple[str, str, bool]]:
    """(what, finding, ok) rows."""
    import mlx.core as mx

    from harness.controller.devices import accelerators
    from harness.controller.environment import blas_info, device_description
    from harness.controller.launch import default_backend, mlx_launch
    from harness.controller.ports import PortError, lease_ports

    rows: list[tuple[str, str, bool]] = [
        ("mlx version", mx.__version__, True),
        ("device", device_description(), True),
    ]
    acc = accelerators()
    rows.append(("GPUs", acc.describe(), True))
    rows.append(("device kind", acc.kind_line(), True))
    rows.append(device_check_row("cpu" if acc.kind == "cpu" else "gpu"))
    avail = [b for b in BACKENDS if mx.distributed.is_available(b)]
    rows.append(("distributed backends", ", ".join(avail) or "none", bool(avail)))
    rows.append(("ranks per backend", acc.ranks_per_backend(avail) or "none", bool(avail)))
    rows.append(("default backend", default_backend(), default_backend() in avail))
    rows += [collectives_row(b) for b in avail]
    launcher = mlx_launch()
    rows.append(("mlx.launch", " ".join(launcher[:1]), bool(launcher)))
    try:
        with lease_ports(4) as lease:
            rows.append(("loopback ports", f"bound a block of 4 at {lease.start}", True))
    except (PortError, OSError) as e:
        rows.append(("loopback ports", f"cannot bind: {e}", False))
    from harness.controller.rank_budget import BUDGET_VAR, budget

    try:
        rows.append(("rank budget", f"{budget()} ranks at once on this machine ({BUDGET_VAR})", True))
    except ValueError as e:
        rows.append(("rank budget", str(e), False))
    rows += memory_rows()
    blas = blas_info()
    rows.append(("BLAS", blas["blas"] + (f" -- {blas['fix']}" if blas["slow"] else ""), not blas["slow"]))
    rows.append(("mpirun", shutil.which("mpirun") or "not found (only needed for --backend mpi)", True))
    return rows


def collectives_row(backend: str) -> tuple[str, str, bool]:
    """What ``backend`` implements of MLX's collectives, probed once per MLX version
    (``harness.controller.backend_ops``); a backend that cannot be probed here is a note."""
    from harness.controller.backend_ops import backend_ops

    ops = backend_ops(backend)
    if isinstance(ops, str):
        return f"collectives ({backend})", f"not probed: {ops}", True
    lacking = [op for op, error in ops.items() if error is not None]
    found = "every one of " + ", ".join(ops) if not lacking else \
        f"all but {', '.join(lacking)} ({'; '.join(str(ops[op]) for op in lacking)})"
    return f"collectives ({backend})", found, True


def device_check_row(device: str) -> tuple[str, str, bool]:
    """The ranks' device check (``harness.rank.device_check``) run once on ``device`` in a
    process of its own, without the collective."""
    import json
    import subprocess
    import sys

    try:
        p = subprocess.run([sys.executable, "-m", "harness.rank.device_check", device], capture_output=True,
                           text=True, timeout=120)
        found = json.loads(p.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return "device check", f"{device}: could not run it ({e})", False
    if found["problems"]:
        return "device check", f"{found['device']} computes wrong: {found['problems'][0]}", False
    return "device check", f"{found['device']}: {' and '.join(found['checks'])} right (numpy's answers)", True


def memory_rows() -> list[tuple[str, str, bool]]:
    """The working set and where it comes from, the memory budget, and a rank's share at 2 and 4
    ranks on this machine (``harness.memory.plan``)."""
    from harness.memory.plan import BUDGET_VAR, format_size, machine_budget, machine_working_set, share_of

    ws = machine_working_set()
    rows = [("working set", f"{format_size(ws.bytes)}: {ws.source}", True)]
    try:
        b = machine_budget()
    except ValueError as e:
        return [*rows, ("memory budget", str(e), False)]
    how = b.source if b.given else f"the working set; --memory-budget or {BUDGET_VAR} sets another"
    rows.append(("memory budget", f"{format_size(b.bytes)} ({how})", True))
    shares = [f"{format_size(share_of(b.bytes, n) if b.given else ws.share(n))} at {n} ranks" for n in (2, 4)]
    rows.append(("memory share per rank", ", ".join(shares), True))
    return rows


def render(rows: list[tuple[str, str, bool]]) -> str:
    table: list[list[Any]] = [[what, "ok" if ok else "WARN", finding] for what, finding, ok in rows]
    return tabulate(table, headers=["Check", "Status", "Finding"], tablefmt="simple")


ALLSUM_MB = 8
ALLSUM_ROUNDS = 6


def measure_allsum(cluster: Any, mb: int = ALLSUM_MB, rounds: int = ALLSUM_ROUNDS) -> tuple[float, float]:
    """One rank per host all-sums ``mb`` MB of float32 ``rounds`` times over ring; (median seconds
    of the rounds after the first, bus bandwidth in MB/s: 2 (N-1)/N x bytes / time, what each
    link carries in a ring all-reduce)."""
    import statistics

    from harness.controller.run_job import LaunchError, execute
    from harness.scenario.job import AllSumJob

    n = len(cluster.hosts)
    job = AllSumJob(value=1.0, rounds=rounds, pause_s=0.0, elems=mb * 1024 * 1024 // 4)
    out = execute("doctor-allsum", job, n, backend="ring", cluster=cluster, wall_s=300, no_progress_s=60)
    if not out.ok:
        raise LaunchError(f"all_sum across the hosts failed: {(out.failure or '').splitlines()[0]}")
    times = [float(e["step_time_s"]) for e in out.ranks[0].events if e.get("kind") == "step"][1:]
    t = statistics.median(times)
    return t, 2 * (n - 1) / n * mb / t


def cluster_checks(cluster: Any) -> list[tuple[str, str, bool]]:
    """(what, finding, ok) rows for each host of ``cluster`` and the links between them."""
    from harness.controller.host_checks import check_hosts

    rows: list[tuple[str, str, bool]] = []
    for i, c in enumerate(check_hosts(cluster, backends=True)):
        h = cluster.hosts[i]
        if c.reach_s is None:
            rows.append((f"{c.host}: SSH", c.problem or "no answer", False))
            continue
        v = c.versions
        rows.append((f"{c.host}: SSH", f"agent answered in {c.reach_s:.2f} s; ranks use {', '.join(h.ips)}", True))
        found = (f"harness {v.get('harness')} (source {v.get('source')}), mlx {v.get('mlx')}, "
                 f"Python {v.get('python')}, {v.get('platform')}")
        rows.append((f"{c.host}: versions", found, not c.problem))
        if c.problem:
            rows.append((f"{c.host}: mismatch", c.problem, False))
        b = c.backends
        if "backends" in b:
            rows.append((f"{c.host}: backends", ", ".join(b["backends"]) + f" (device {b.get('device')})",
                         "ring" in b["backends"]))
        else:
            rows.append((f"{c.host}: backends", str(b.get("error")), False))
    if len(cluster.hosts) > 1 and all(ok for _, _, ok in rows):
        from harness.controller.run_job import LaunchError

        try:
            t, bw = measure_allsum(cluster)
            rows.append(("all_sum between hosts", f"{ALLSUM_MB} MB float32 over ring, one rank per host: median "
                         f"{t * 1000:.1f} ms, bus bandwidth {bw:.1f} MB/s", True))
        except LaunchError as e:
            rows.append(("all_sum between hosts", str(e), False))
    return rows
