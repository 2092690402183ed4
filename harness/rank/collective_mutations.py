"""Collective mutations: DDP bugs planted in any Python trainer's gradient all-reduce, with no
change to its code, through the collective ledger's interposition (``harness.rank.ledger``).

A run's ``mutation`` names one of ``COLLECTIVE_MUTATIONS`` (``harness.scenario.names``). It acts
on each ``all_sum`` of a gradient: a floating array of more than one element issued from the
trainer's own code (a call site outside MLX and the harness: the harness's own consensus and
device-check collectives are left alone, and so are scalar sums, the loss and token counts).
Every rank mutates alike, so the ranks still issue the same collectives and the run completes: a
check has to catch what it did to the training.
"""

from __future__ import annotations

from typing import Any


def is_gradient(x: Any) -> bool:
    import mlx.core as mx

    return isinstance(x, mx.array) and x.size > 1 and mx.issubdtype(x.dtype, mx.floating)


def mutated_all_sum(mutation: str, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    rank: int, world_size: int) -> Any:
    """What ``all_sum(*args, **kwargs)`` returns under ``mutation``."""
    import mlx.core as mx

    x, rest = (args[0], args[1:]) if args else (kwargs["x"], ())
    kw = {k: v for k, v in kwargs.items() if k != "x"}
    group = kw.get("group")
    if group is not None:
        rank, world_size = group.rank(), group.size()
    if mutation == "allreduce_skipped":  # each rank keeps its own gradient
        return x
    if mutation == "allreduce_not_averaged":  # the sum arrives N times what an average would be
        return original(x, *rest, **kw) * world_size
    if mutation == "rank_dropped":  # the last rank's contribution never reaches the sum
        return original(mx.zeros_like(x) if rank == world_size - 1 else x, *rest, **kw)
    raise ValueError(f"unknown collective mutation {mutation!r}")
