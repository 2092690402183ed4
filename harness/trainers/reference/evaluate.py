"""Sharded eval: each rank scores its rows, then one token-weighted reduction over all ranks.

Every rank runs the same number of eval batches (short ranks are padded with empty rows that
carry zero tokens). A rank never divides by its own token count, so a rank with only padding
adds 0 to the sum instead of 0/0. The reduced loss comes from one all-sum, so it is the same
bits on every rank, and equal to one process scoring all the rows.
"""

from __future__ import annotations

import math
from typing import Any

from harness.rank.consensus import Coordinator
from harness.trainers.reference.batching import EvalShare, collate
from harness.trainers.reference.step import loss_fn


def _local(model: Any, share: EvalShare, pad_id: int, vlm: bool, pad_to: int) -> tuple[Any, int]:
    import mlx.core as mx

    total, tokens = mx.array(0.0, dtype=mx.float32), 0
    for rows in share.batches:
        b = collate(rows, pad_id, vlm=vlm, pad_to=pad_to)
        _, loss_sum = loss_fn(model, b.arrays(), 1.0, None)
        total = total + loss_sum
        tokens += b.tokens
        mx.eval(total)
    return total, tokens


def evaluate(model: Any, share: EvalShare, pad_id: int, coord: Coordinator, step: int,
             before: Any = None, vlm: bool = False, pad_to: int = 1) -> dict[str, Any]:
    """Eval metrics after optimizer step ``step``, identical on every rank.

    ``before`` runs first inside the eval phase (fault injection); its result is returned as
    ``"requested"``.
    """
    import mlx.core as mx

    def local() -> tuple[Any, int, Any]:
        requested = before() if before else None
        return (*_local(model, share, pad_id, vlm, pad_to), requested)

    out = coord.attempt("eval", step, local)
    agreed = coord.agree([out[1] if out else 0])
    tokens = agreed.values[0]
    if tokens == 0:
        raise coord.stop_all(f"eval after step {step}: zero supervised tokens across all {coord.world_size} ranks")
    loss_sum = out[0] if out else mx.array(0.0, dtype=mx.float32)
    loss = float((mx.distributed.all_sum(loss_sum, group=coord.group) / tokens).item())
    return {
        "step": step,
        "loss": loss,
        "ppl": math.exp(min(loss, 50.0)),
        "tokens": tokens,
        "tokens_local": out[1] if out else 0,
        "rows_local": share.real_rows,
        "pad_rows_local": share.pad_rows,
        "requested": out[2] if out else None,
    }
