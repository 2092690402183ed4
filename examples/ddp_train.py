"""A data-parallel MLX training script that reports to mlx-ddp-harness: copy it and make it yours.

Run it through a scenario (``scenarios/script_example.toml``)::

    mlx-ddp-harness run scenarios/script_example.toml

The harness starts this file in every rank (1 process, or N ranks under ``mlx.launch``) and
judges what it reports: N ranks must reproduce one process. The step below is correct DDP:
rank r takes every N-th row of each global batch, the loss is the sum of token losses over the
global batch's supervised token count (all-summed), and ``nn.average_gradients`` makes every
rank apply the same update. Replace the model, the rows or the step with your own; keep the
``run.probe`` / ``run.step`` / ``run.finish`` calls.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from harness import api


def collate(rows):
    """Pad a list of (ids, supervised) rows: inputs, next-token targets and the target mask."""
    width = max(len(ids) for ids, _ in rows) - 1
    inputs = np.zeros((len(rows), width), np.int32)
    targets = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.float32)
    for i, (ids, supervised) in enumerate(rows):
        n = len(ids) - 1
        inputs[i, :n], targets[i, :n], mask[i, :n] = ids[:-1], ids[1:], supervised[1:]
    return mx.array(inputs), mx.array(targets), mx.array(mask)


def scaled(grads, factor):
    """Each gradient times ``factor`` (a float32 array), back in the gradient's own dtype: left as
    the float32 product, a bfloat16 model's update would turn its weights float32."""
    return tree_map(lambda g: (g * factor).astype(g.dtype), grads)


def token_loss_sum(model, inputs, targets, mask):
    logits = model(inputs)
    return (nn.losses.cross_entropy(logits, targets) * mask).astype(mx.float32).sum()


def main():
    run = api.session()
    group = mx.distributed.init()  # the group the harness already joined
    rank, size = group.rank(), group.size()

    model = run.model()
    rows = run.rows()
    optimizer = run.optimizer()
    grad_fn = nn.value_and_grad(model, token_loss_sum)
    rng = np.random.default_rng(run.seed)  # a local RNG: the same batch order on every rank
    order = []

    def global_loss_and_grad(inputs, targets, mask):
        """The step's global loss, all-reduced gradient and supervised tokens, from this rank's rows."""
        tokens = mx.distributed.all_sum(mask.sum(), group=group)
        loss_sum, grads = grad_fn(model, inputs, targets, mask)
        # sum over ranks of (local token-loss gradient x N / T), averaged: the global gradient / T
        grads = nn.average_gradients(scaled(grads, size / tokens), group=group)
        return mx.distributed.all_sum(loss_sum, group=group) / tokens, grads, tokens

    for step in range(1, run.steps + 1):
        while len(order) < run.global_batch:
            order.extend(rng.permutation(len(rows)).tolist())
        batch, order = order[: run.global_batch], order[run.global_batch :]
        mine = [rows[i] for i in batch[rank::size]]
        inputs, targets, mask = collate(mine)
        # step-local parity: the harness may call this at the reference run's parameters
        run.probe(step, model, global_loss_and_grad, inputs, targets, mask)

        loss, grads, tokens = global_loss_and_grad(inputs, targets, mask)
        optimizer.update(model, grads)
        tokens_local = mask.sum()
        mx.eval(model.parameters(), optimizer.state, loss, tokens, tokens_local)

        run.step(step, loss.item(), int(tokens.item()), int(tokens_local.item()),
                 lr=optimizer.learning_rate.item(), params=model.parameters())

    if rank == 0:  # save once, on rank 0
        mx.save_safetensors(str(run.run_dir / "model.safetensors"), dict(tree_flatten(model.parameters())))
        run.saved()
    run.finish(model.parameters())


if __name__ == "__main__":
    main()
