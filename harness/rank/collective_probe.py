"""What a backend implements: each collective of the job's ``ops`` tried once on a few float32
values by every rank of a 2-rank launch (``harness.controller.backend_ops``), and what MLX raised
for each it lacks. ``send`` is rank 0 sending to rank 1 (which receives), ``recv`` the reverse;
they come last, as an exchange one side lacks may leave the other waiting."""

from __future__ import annotations

from typing import Any

from harness.rank.context import RankContext

P2P = ("send", "recv")


def _try(ctx: RankContext, op: str) -> str | None:
    import mlx.core as mx

    x, group, peer = mx.ones((2 * ctx.world_size,)), ctx.group, 1 - ctx.rank
    dist = mx.distributed
    try:
        if op in P2P:
            sender = 0 if op == "send" else 1
            y = dist.send(x, peer, group=group) if ctx.rank == sender else dist.recv_like(x, peer, group=group)
        else:
            y = getattr(dist, op)(x, group=group)
        mx.eval(y)
    except Exception as e:  # noqa: BLE001 - what MLX says of an op the backend lacks is the finding
        return f"{type(e).__name__}: {e}"
    return None


def run(ctx: RankContext) -> dict[str, Any]:
    """Each op's outcome, also as an event as it ends (a probe that hangs in an exchange still
    tells what came before)."""
    found: dict[str, str | None] = {}
    for op in sorted(ctx.job.ops, key=lambda op: op in P2P):
        found[op] = _try(ctx, op)
        ctx.events.emit("collective_probe", rank=ctx.rank, op=op, error=found[op])
    return {"ops": found}
