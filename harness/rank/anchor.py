"""The speed anchor: mlx-lm's own training step in a plain loop, on random tokens.

The step has the shape of ``mlx_lm.tuner.trainer.train``'s: its ``default_loss`` (the mean
token loss of the micro-batch), ``nn.average_gradients`` across the ranks and the optimizer's
update, compiled together over the model's and optimizer's state when the scenario compiles.
There is no data pipeline, evaluation or bookkeeping: every rank draws rows of ``max_seq_len``
random token ids (its own, from the scenario seed; ``max_seq_len - 1`` inputs each, the
``input_widths`` it reports), so the figure is the step alone. Benchmarks time it beside the
reference trainer and mlx-lm's own trainer on the same model, dtype, per-rank batch and world
size. ``mlx_compile`` in its result says whether MLX compiles in the rank at all (not under
``MLX_DISABLE_COMPILE``).

``allreduce`` (job kind ``grad_allreduce``) times ``nn.average_gradients`` alone on a gradient
tree of the model's shapes and dtype: the all-reduce a DDP step pays, without the step.
"""

from __future__ import annotations

import time
from typing import Any

from harness.rank.context import RankContext


def _model(ctx: RankContext) -> tuple[Any, Any, int]:
    """The scenario, its model (built as the reference trainer builds it) and the vocabulary size."""
    from harness.data.tokenizers import load_tokenizer
    from harness.rank.models import build_model

    s = ctx.job.scenario
    ctx.phase("model")
    vocab = load_tokenizer(s.data).vocab_size
    model, _ = build_model(s.model, vocab, s.seed)
    return s, model, vocab


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
    import numpy as np
    from mlx_lm.tuner.trainer import default_loss

    from harness.rank.models import param_count
    from harness.rank.optimizer import build_optimizer

    s, model, vocab = _model(ctx)
    t = s.train
    optimizer = build_optimizer(t)
    rows, length = t.global_batch // ctx.world_size, s.data.max_seq_len
    rng = np.random.default_rng([s.seed, ctx.rank])
    batch = mx.array(rng.integers(0, vocab, size=(rows, length), dtype=np.int32))
    lengths = mx.array([[1, length - 1]] * rows)  # every target of every row counts
    value_and_grad = nn.value_and_grad(model, default_loss)

    def step(batch: Any, lengths: Any) -> Any:
        (loss, tokens), grads = value_and_grad(model, batch, lengths)
        optimizer.update(model, nn.average_gradients(grads))
        return loss, tokens

    state = [model.state, optimizer.state]
    if t.compile != "off":
        step = mx.compile(step, inputs=state, outputs=state)
    ctx.phase("train")
    tok_s, times = [], []
    for k in range(1, t.steps + 1):
        t0 = time.perf_counter()
        loss, tokens = step(batch, lengths)
        t1 = time.perf_counter()
        mx.eval(state, loss, tokens)
        dt = time.perf_counter() - t0
        times.append(dt)
        tok_s.append(int(tokens.item()) * ctx.world_size / dt)
        ctx.events.emit("step", step=k, rank=ctx.rank, loss=float(loss.item()), step_time_s=dt,
                        fetch_s=0.0, build_s=t1 - t0, eval_s=t0 + dt - t1)
    return {"tok_s_global": tok_s, "step_times_s": times, "param_count": param_count(model),
            "tokens_global_per_step": rows * (length - 1) * ctx.world_size, "compile": t.compile != "off",
            "input_widths": [length - 1] * t.steps, "mlx_compile": compile_enabled()}
