"""A user's LoRA fine-tune under data parallelism, reporting to mlx-ddp-harness: a bfloat16 base
(as checkpoints are stored), mlx-lm's LoRA adapters in float32 on it, AdamW, the gradient clipped
after the all-reduce. Run it with ``mlx-ddp-harness run examples/lora_script.toml``.

The base is cast to ``LORA_DTYPE`` (default ``bfloat16``; ``float32`` to train in float32): the
harness sees the dtype from the weights, so the scenario declares none. Only the adapters train,
and they are what the script hands to ``run.step`` and ``run.finish``.
"""

import os

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map
from mlx_lm.tuner.utils import linear_to_lora_layers

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


def token_loss_sum(model, inputs, targets, mask):
    """The summed cross-entropy of the supervised next-token targets, in float32."""
    return (nn.losses.cross_entropy(model(inputs), targets) * mask).astype(mx.float32).sum()


def main():
    run = api.session()
    group = mx.distributed.init()
    rank, size = group.rank(), group.size()

    model = run.model()  # the scenario's base, seeded alike on every rank
    model.set_dtype(getattr(mx, os.environ.get("LORA_DTYPE", "bfloat16")))
    model.freeze()
    mx.random.seed(run.seed)  # mlx-lm draws the adapters from MLX's global RNG: the same on every rank
    linear_to_lora_layers(model, len(model.layers), {"rank": 8, "scale": 20.0, "dropout": 0.0})
    model = run.split(model)  # training starts here, from the adapters just drawn
    rows = run.rows()
    optimizer = optim.AdamW(learning_rate=run.learning_rate)
    grad_fn = nn.value_and_grad(model, token_loss_sum)
    order = np.random.default_rng(run.seed)  # a local RNG: the same batch order on every rank
    queue = []

    def global_loss_and_grad(inputs, targets, mask):
        """The step's global loss, all-reduced gradient and supervised tokens, from this rank's rows."""
        tokens = mx.distributed.all_sum(mask.sum(), group=group)
        loss_sum, grads = grad_fn(model, inputs, targets, mask)
        grads = tree_map(lambda g: mx.distributed.all_sum(g, group=group) / tokens, grads)
        return mx.distributed.all_sum(loss_sum, group=group) / tokens, grads, tokens

    for step in range(1, run.steps + 1):
        while len(queue) < run.global_batch:
            queue.extend(order.permutation(len(rows)).tolist())
        batch, queue = queue[: run.global_batch], queue[run.global_batch:]
        inputs, targets, mask = collate([rows[i] for i in batch[rank::size]])
        run.probe(step, model, global_loss_and_grad, inputs, targets, mask)
        loss, grads, tokens = global_loss_and_grad(inputs, targets, mask)
        grads, _ = optim.clip_grad_norm(grads, 1.0)  # after the all-reduce: the global gradient's norm
        optimizer.update(model, grads)
        mx.eval(model.trainable_parameters(), optimizer.state, loss, tokens)
        run.step(step, loss.item(), int(tokens.item()), int(mask.sum().item()),
                 lr=optimizer.learning_rate.item(), params=model.trainable_parameters())

    run.finish(model.trainable_parameters())


if __name__ == "__main__":
    main()
