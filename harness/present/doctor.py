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
    avail = [b for b in BACKENDS if mx.distributed.is_available(b)]
    rows.append(("distributed backends", ", ".join(avail) or "none", bool(avail)))
    rows.append(("ranks per backend", acc.ranks_per_backend(avail) or "none", bool(avail)))
    rows.append(("default backend", default_backend(), default_backend() in avail))
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
    blas = blas_info()
    rows.append(("BLAS", blas["blas"] + (f" -- {blas['fix']}" if blas["slow"] else ""), not blas["slow"]))
    rows.append(("mpirun", shutil.which("mpirun") or "not found (only needed for --backend mpi)", True))
    return rows


def render(rows: list[tuple[str, str, bool]]) -> str:
    table: list[list[Any]] = [[what, "ok" if ok else "WARN", finding] for what, finding, ok in rows]
    return tabulate(table, headers=["Check", "Status", "Finding"], tablefmt="simple")
