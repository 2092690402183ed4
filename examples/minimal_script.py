"""The smallest data-parallel MLX script the harness can judge: an MLP language model on the
scenario's rows, trained in the style of MLX's distributed guide (every rank takes its share of
each global batch, the gradients are averaged with an all-reduce), reporting through
``harness.api``. Run it with ``mlx-ddp-harness run examples/minimal_script.toml``; docs/scripts.md
explains every call."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from harness import api


class MLP(nn.Module):
    """Predicts the next token from the current one."""

    def __init__(self, vocab: int, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, vocab)

    def __call__(self, x):
        return self.out(nn.relu(self.hidden(self.embed(x))))


def token_loss_sum(model, inputs, targets, mask):
    """The summed cross-entropy of the supervised next-token targets."""
    return (nn.losses.cross_entropy(model(inputs), targets) * mask).sum()


def global_gradient(grads, tokens, group):
    """The ranks' gradients summed (an all-reduce) over the global batch's supervised tokens, each
    in its own dtype (``tokens`` is float32: a bfloat16 model would otherwise train in float32)."""
    return tree_map(lambda g: (mx.distributed.all_sum(g, group=group) / tokens).astype(g.dtype), grads)


def main():
    run = api.session()  # 1. this rank's session: rank, world size, seed, steps, global batch
    group = mx.distributed.init()  # the group the harness already joined
    rank, size = group.rank(), group.size()
    rows = run.rows()  # 2. the scenario's rows: (token ids, supervised mask) each
    vocab = max(int(ids.max()) for ids, _ in rows) + 1

    mx.random.seed(run.seed)  # the same weights on every rank and in every run
    model = run.split(MLP(vocab))  # 3. training starts from these weights
    optimizer = run.optimizer()  # the scenario's optimizer (or your own)
    grad_fn = nn.value_and_grad(model, token_loss_sum)
    order = np.random.default_rng(run.seed).permutation(len(rows))  # a local RNG: the same order everywhere

    def global_loss_and_grad(inputs, targets, mask):
        """The step's global loss, all-reduced gradient and supervised tokens, from this rank's rows."""
        tokens = mx.distributed.all_sum(mask.sum(), group=group)  # the global batch's supervised tokens
        loss_sum, grads = grad_fn(model, inputs, targets, mask)
        grads = global_gradient(grads, tokens, group)
        return mx.distributed.all_sum(loss_sum, group=group) / tokens, grads, tokens

    width = max(len(ids) for ids, _ in rows) - 1
    for step in range(1, run.steps + 1):
        picked = [rows[order[((step - 1) * run.global_batch + i) % len(rows)]] for i in range(run.global_batch)]
        mine = picked[rank::size]  # this rank's share of the global batch
        inputs = np.zeros((len(mine), width), np.int32)
        targets, mask = np.zeros_like(inputs), np.zeros(inputs.shape, np.float32)
        for i, (ids, supervised) in enumerate(mine):
            n = len(ids) - 1
            inputs[i, :n], targets[i, :n], mask[i, :n] = ids[:-1], ids[1:], supervised[1:]
        inputs, targets, mask = mx.array(inputs), mx.array(targets), mx.array(mask)

        # step-local parity: at the steps the harness probes, it calls the step's function at the
        # reference run's parameters (and puts the model's own back); at the others it returns at once
        run.probe(step, model, global_loss_and_grad, inputs, targets, mask)
        loss, grads, tokens = global_loss_and_grad(inputs, targets, mask)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss, tokens)
        # 4. the step: global loss, global and local supervised tokens, and the parameters after it
        run.step(step, loss.item(), int(tokens.item()), int(mask.sum().item()),
                 lr=optimizer.learning_rate.item(), params=model.parameters())

    run.finish(model.parameters())  # 5. the final parameters, judged for parity


if __name__ == "__main__":
    main()
