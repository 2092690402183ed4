"""The ranks of one machine meet before MLX's ring connects them, so that no rank dials a peer
that is not yet listening.

MLX's ring has every rank but the last listen for its left neighbour first and then dial its
right one; the last rank dials rank 0 first. A dial that finds no listener waits 1 s (then 2, 4,
8, 16 s) before it tries again, so a last rank that starts faster than rank 0 costs the launch a
second or more. Here each rank leaves a mark in the run directory just before it joins the
group, and the last rank joins once every rank has left its mark (and a moment more, for rank 0
to reach its listen), or after ``WAIT_S`` whatever the others do. Ranks on cluster hosts do not
share a run directory and skip it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from harness import schema

REMOTE_VAR = schema.HOST_ROOT_VAR  # set for ranks on cluster hosts
WAIT_S = 30.0  # at most this long for the other ranks; MLX's own retries take over after it
SETTLE_S = 0.02  # after the last mark: the others' step from their mark to their listen
POLL_S = 0.002


def mark_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"ring-arrived.{rank}"


def meet(run_dir: Path, rank: int, world_size: int, backend: str | None) -> float:
    """Leave this rank's mark; the last rank waits for every mark. Returns the seconds waited."""
    if backend != "ring" or world_size < 2 or os.environ.get(REMOTE_VAR):
        return 0.0
    mark_path(run_dir, rank).touch()
    if rank != world_size - 1:
        return 0.0
    t0 = time.monotonic()
    deadline = t0 + WAIT_S
    while time.monotonic() < deadline:
        if all(mark_path(run_dir, r).exists() for r in range(world_size - 1)):
            time.sleep(SETTLE_S)
            break
        time.sleep(POLL_S)
    return time.monotonic() - t0
