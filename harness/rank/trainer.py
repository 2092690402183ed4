"""The reference DDP trainer for text: one readable loop, token-weighted across ranks.

Each optimizer step, every rank:
  1. takes its rows of the global batch (``data.shard``) and pads them locally;
  2. all-sums its supervised token count into the global count T;
  3. computes the gradient of (sum of its token losses) * N / T;
  4. averages gradients with ``nn.average_gradients`` (sum / N), which leaves
     sum over all ranks' token-loss gradients / T: exactly the single-process update of the
     same global batch;
  5. all-sums its loss sum for the logged global loss, sum / T.
"""

from __future__ import annotations

import time
from typing import Any

from harness.rank import data as rank_data
from harness.rank.entry import RankContext
from harness.rank.models import build_model, param_count, param_digest
from harness.scenario import Scenario


def _save_params(model: Any, ctx: RankContext) -> None:
    """Rank 0 writes the final parameters; a reader never sees a partial file."""
    import os

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from harness import schema

    final = schema.params_path(ctx.run_dir)
    tmp = final.with_name(".rank0.params.tmp.safetensors")
    mx.save_safetensors(str(tmp), dict(tree_flatten(model.parameters())))
    os.replace(tmp, final)


def run(ctx: RankContext) -> dict[str, Any]:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import psutil

    scenario = Scenario.from_dict(ctx.job["scenario"])
    spec, N, proc = scenario.train, ctx.world_size, psutil.Process()

    ctx.phase("data")
    tok = rank_data.load_tokenizer(scenario.data)
    texts = rank_data.load_texts(scenario.data, scenario.seed)
    rows = rank_data.tokenize(texts, tok, scenario.data.max_seq_len)
    plan = rank_data.global_batches(len(rows), spec.global_batch, spec.steps)

    ctx.phase("model")
    model, config = build_model(scenario.model, tok.vocab_size, scenario.seed)
    optimizer = optim.AdamW(learning_rate=spec.learning_rate, weight_decay=spec.weight_decay)
    digests = {0: param_digest(model)}

    def loss_fn(model: Any, inputs: Any, targets: Any, mask: Any, scale: Any) -> tuple[Any, Any]:
        logits = model(inputs).astype(mx.float32)
        token_loss = nn.losses.cross_entropy(logits, targets, reduction="none") * mask
        loss_sum = token_loss.sum()
        return loss_sum * scale, loss_sum

    value_and_grad = nn.value_and_grad(model, loss_fn)

    ctx.phase("train")
    losses, step_times, local_tok_s, global_tok_s = [], [], [], []
    tokens_local_total = tokens_global_total = 0
    rss_peak = proc.memory_info().rss
    t_train = time.perf_counter()
    for step in range(1, spec.steps + 1):
        ctx.maybe_fault(step)
        t0 = time.perf_counter()
        local_rows = rank_data.shard(plan[step - 1], ctx.rank, N)
        batch = rank_data.collate([rows[i] for i in local_rows], tok.pad_id)
        tokens_global = int(mx.distributed.all_sum(mx.array(batch.tokens), group=ctx.group).item())
        scale = mx.array(N / tokens_global, dtype=mx.float32)
        (_, loss_sum), grads = value_and_grad(
            model, mx.array(batch.inputs), mx.array(batch.targets), mx.array(batch.mask), scale
        )
        grads = nn.average_gradients(grads, group=ctx.group)
        optimizer.update(model, grads)
        global_loss = mx.distributed.all_sum(loss_sum, group=ctx.group) / tokens_global
        mx.eval(model.parameters(), optimizer.state, global_loss)
        dt = time.perf_counter() - t0

        loss = float(global_loss.item())
        rss = proc.memory_info().rss
        rss_peak = max(rss_peak, rss)
        losses.append(loss)
        step_times.append(dt)
        local_tok_s.append(batch.tokens / dt)
        global_tok_s.append(tokens_global / dt)
        tokens_local_total += batch.tokens
        tokens_global_total += tokens_global
        event: dict[str, Any] = dict(
            step=step, rank=ctx.rank, loss=loss, tokens_global=tokens_global,
            tokens_local=batch.tokens, rows_local=len(local_rows), step_time_s=dt,
            mlx_peak_bytes=int(mx.get_peak_memory()), rss_bytes=rss,
        )
        if spec.digest_every and step % spec.digest_every == 0:
            digests[step] = event["digest"] = param_digest(model)
        ctx.events.emit("step", **event)
    runtime = time.perf_counter() - t_train

    ctx.phase("save")
    digests[spec.steps] = param_digest(model)
    if ctx.is_main:
        _save_params(model, ctx)
    return {
        "steps": spec.steps,
        "losses": losses,
        "step_times_s": step_times,
        "tok_s_local": local_tok_s,
        "tok_s_global": global_tok_s,
        "tokens_local": tokens_local_total,
        "tokens_global": tokens_global_total,
        "runtime_s": runtime,
        "rss_step_peak_bytes": rss_peak,
        "digests": {str(k): v for k, v in digests.items()},
        "final_digest": digests[spec.steps],
        "param_count": param_count(model),
        "model_config": config,
        "rows": len(rows),
        "rows_per_rank_step": len(rank_data.shard(plan[0], ctx.rank, N)),
    }
