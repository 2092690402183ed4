"""A minimal collective job: each round all-sums this job's own value (``elems`` float32 values,
4096 unless the job says), and records the sums and each round's time.

Used to prove that concurrent launches stay isolated (a cross-talk shows as a wrong sum) and to
exercise failure handling without a model.
"""

from __future__ import annotations

import os
import time
from typing import Any

from harness.rank.context import RankContext


def run(ctx: RankContext) -> dict[str, Any]:
    if ctx.job.ops:  # which collectives the backend implements
        from harness.rank import collective_probe

        return collective_probe.run(ctx)
    import mlx.core as mx

    value, rounds, pause = ctx.job.value, ctx.job.rounds, ctx.job.pause_s
    sums = []
    for step in range(1, rounds + 1):
        fault = ctx.maybe_fault("step", step)
        if fault is not None and fault.action == "raise":
            raise RuntimeError(f"injected fault at step {step}")
        t0 = time.perf_counter()
        x = mx.full((ctx.job.elems or 4096,), value * step + ctx.rank, dtype=mx.float32)
        s = mx.distributed.all_sum(x, group=ctx.group)
        mx.eval(s)
        lo, hi = float(s.min()), float(s.max())
        sums.append(lo if lo == hi else [lo, hi])
        print(f"rank {ctx.rank} round {step} sum {sums[-1]}", flush=True)
        ctx.events.emit("step", step=step, rank=ctx.rank, step_time_s=time.perf_counter() - t0)
        time.sleep(pause)
    return {"sums": sums, "mlx_env": sorted(k for k in os.environ if k.startswith("MLX_") and "HARNESS" not in k)}
