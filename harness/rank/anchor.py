"""The speed anchor: mlx-lm's own training step in a plain loop, on the scenario's rows.

The step has the shape of ``mlx_lm.tuner.trainer.train``'s: its ``default_loss`` (the mean
token loss of the micro-batch), ``nn.average_gradients`` across the ranks and the optimizer's
update, compiled together over the model's and optimizer's state when the scenario compiles.
There is no data pipeline, evaluation or bookkeeping: the scenario's train rows are tokenized
once, before the timed steps, into one batch per global batch (``row_batches``), so the figure is
the step alone. Its tokens are the scenario's, not random ids: on a CUDA GPU a step's time depends
on the tokens (qwen3 0.44B evaluated its step 3 to 7 ms longer on byte-tokenized text than on
uniform random ids). Where the scenario trains its rows in order, every token a target, in one
micro-batch, rows filling ``max_seq_len`` (as ``benchmarks/step_vs_mlx_lm.py``'s does), these are
the reference trainer's rows and widths; otherwise the anchor still takes its rows in order,
counts every token as a target and pads to ``max_seq_len``. Benchmarks time it beside the
reference trainer and mlx-lm's own trainer on the same model, dtype, per-rank batch and world
size. ``mlx_compile`` in its result says whether MLX compiles in the rank at all (not under
``MLX_DISABLE_COMPILE``). Where a benchmark has it take turns with the reference trainer
(``harness.rank.turns``), rank 0 waits for its turn between steps, outside their times.

``allreduce`` (job kind ``grad_allreduce``) times ``nn.average_gradients`` alone on a gradient
tree of the model's shapes and dtype: the all-reduce a DDP step pays, without the step.
"""

from __future__ import annotations

import time
from typing import Any

from harness.rank import turns
from harness.rank.context import RankContext


def _model(ctx: RankContext) -> tuple[Any, Any, Any]:
    """The scenario, its model (built as the reference trainer builds it) and its tokenizer."""
    from harness.data.tokenizers import load_tokenizer
    from harness.rank.models import build_model

    s = ctx.job.scenario
    ctx.phase("model")
    tok = load_tokenizer(s.data)
    model, _ = build_model(s.model, tok.vocab_size, s.seed)
    return s, model, tok


def row_batches(s: Any, tok: Any, rank: int, world_size: int) -> list[tuple[Any, Any, int]]:
    """The scenario's train rows as mlx-lm's step takes them: per global batch of the rows in
    their source order (wrapping around at the end), this rank's rows, strided as the reference
    trainer shares a global batch (rank r: positions r, r + N, ...), as (token ids padded with
    the pad id to ``max_seq_len``, each row's ``[1, tokens - 1]`` lengths: every target counts,
    the global batch's targets on all ranks)."""
    import numpy as np

    from harness.data.sources import Encoder, row_source

    encode = Encoder(tok, s.data)
    ids = [encode(where, row).ids for where, row in row_source(s.data, s.seed, "train")()]
    if not ids:
        raise ValueError("the dataset has no rows")
    g, width = s.train.global_batch, s.data.max_seq_len
    out = []
    for first in range(0, len(ids), g):
        rows = [ids[(first + j) % len(ids)] for j in range(g)]
        mine = rows[rank::world_size]
        batch = np.full((len(mine), width), tok.pad_id, dtype=np.int32)
        for i, row in enumerate(mine):
            batch[i, : len(row)] = row
        lengths = np.array([[1, len(row) - 1] for row in mine], dtype=np.int32)
        out.append((batch, lengths, sum(len(row) - 1 for row in rows)))
    return out


def allreduce(ctx: RankContext) -> dict[str, Any]:
    """Median seconds of ``nn.average_gradients`` over a zero gradient of the model's
    parameters (``repeats`` timed calls after 2 untimed ones)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map

    _, model, _ = _model(ctx)
    grads = tree_map(mx.zeros_like, model.trainable_parameters())
    mx.eval(grads)
    ctx.phase("train")
    times = []
    for k in range(2 + (ctx.job.repeats or 10)):
        t0 = time.perf_counter()
        mx.eval(nn.average_gradients(grads))
        if k >= 2:
            times.append(time.perf_counter() - t0)
    times.sort()
    return {"allreduce_s": times[len(times) // 2], "times_s": times,
            "bytes": sum(g.nbytes for _, g in tree_flatten(grads))}


def compile_enabled() -> bool:
    """Whether ``mx.compile`` compiles in this process: a compiled function is traced once for
    repeated calls on one shape, and called every time when compiling is disabled."""
    import mlx.core as mx

    calls = []
    f = mx.compile(lambda x: calls.append(1) or x + 1)
    for _ in range(3):
        mx.eval(f(mx.zeros((2,))))
    return len(calls) == 1


def run(ctx: RankContext) -> dict[str, Any]:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.tuner.trainer import default_loss

    from harness.rank.models import param_count
    from harness.rank.optimizer import build_optimizer

    s, model, tok = _model(ctx)
    t = s.train
    optimizer = build_optimizer(t)
    # on the device only the batches the steps train
    batches = [(mx.array(b), mx.array(n), g) for b, n, g in row_batches(s, tok, ctx.rank, ctx.world_size)[: t.steps]]
    length = s.data.max_seq_len
    value_and_grad = nn.value_and_grad(model, default_loss)

    def step(batch: Any, lengths: Any) -> Any:
        (loss, tokens), grads = value_and_grad(model, batch, lengths)
        optimizer.update(model, nn.average_gradients(grads))
        return loss, tokens

    state = [model.state, optimizer.state]
    if t.compile != "off":
        step = mx.compile(step, inputs=state, outputs=state)
    ctx.phase("train")
    tok_s, times, counts = [], [], []
    taking_turns = ctx.rank == 0  # rank 0 takes a benchmark's turns, where it has them
    try:
        for k in range(1, t.steps + 1):
            batch, lengths, global_tokens = batches[(k - 1) % len(batches)]
            t0 = time.perf_counter()
            loss, tokens = step(batch, lengths)
            t1 = time.perf_counter()
            mx.eval(state, loss, tokens)
            dt = time.perf_counter() - t0
            times.append(dt)
            counts.append(global_tokens)
            tok_s.append(global_tokens / dt)
            ctx.events.emit("step", step=k, rank=ctx.rank, loss=float(loss.item()), step_time_s=dt,
                            fetch_s=0.0, build_s=t1 - t0, eval_s=t0 + dt - t1)
            if taking_turns:
                turns.after(k)
    finally:
        if taking_turns:
            turns.hand_on()
    return {"tok_s_global": tok_s, "step_times_s": times, "param_count": param_count(model),
            "tokens_global_per_step": counts, "compile": t.compile != "off",
            "input_widths": [length - 1] * t.steps, "mlx_compile": compile_enabled()}
