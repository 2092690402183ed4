"""The eager DDP step of the gpu044b model (qwen3, 440M parameters, bfloat16, 8 x 1024 tokens per
rank) with its gradient all-reduce scheduled in different ways, outside the harness:

    python benchmarks/allreduce_overlap.py VARIANTS [STEPS]            # one process
    mlx.launch --backend nccl -n 2 -- python benchmarks/allreduce_overlap.py VARIANTS [STEPS]

VARIANTS is a comma-separated list, each timed for STEPS steps (default 40) in turn in the same
processes (list a variant twice to see the drift between its turns); rank 0 prints the median
and the fastest step after the first three:

- ``mlx``: ``mlx.nn.average_gradients`` (32 MiB buckets in parameter order, the default stream);
- otherwise buckets of 64 MiB (``b32``: 32 MiB) built here: ``rev`` in reverse parameter order
  (last layers first), ``order`` scheduling the reduced buckets with ``mx.async_eval`` before the
  update is evaluated, ``stream`` all-reducing on a second GPU stream.

In one process every variant is the plain step (no all-reduce).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import qwen3

CONFIG = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "intermediate_size": 3072,
          "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
          "vocab_size": 512, "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": True}


def buckets_reduced(grads: Any, n: int, reverse: bool, stream: Any, mib: int,
                    group: Any = None) -> tuple[Any, list[Any]]:
    """The gradients averaged over ``n`` ranks (of ``group``) in buckets of ``mib`` MiB, and the
    reduced buckets."""
    flat = tree_flatten(grads)[::-1] if reverse else tree_flatten(grads)
    groups, cur, size = [], [], 0
    for k, v in flat:
        cur.append((k, v))
        size += v.nbytes
        if size >= mib * 2**20:
            groups.append(cur)
            cur, size = [], 0
    groups += [cur] if cur else []
    out, reduced = [], []
    for bucket in groups:
        big = mx.distributed.all_sum(mx.concatenate([v.reshape(-1) for _, v in bucket]), group=group,
                                      stream=stream) / n
        reduced.append(big)
        cuts, at = [], 0
        for _, v in bucket[:-1]:
            at += v.size
            cuts.append(at)
        out += [(k, p.reshape(v.shape)) for (k, v), p in zip(bucket, mx.split(big, cuts), strict=True)]
    return tree_unflatten(out), reduced


def main() -> None:
    variants, steps = sys.argv[1].split(","), int(sys.argv[2]) if len(sys.argv) > 2 else 40
    group = mx.distributed.init()
    n, rank = group.size(), group.rank()
    model = qwen3.Model(qwen3.ModelArgs.from_dict(CONFIG))
    model.set_dtype(mx.bfloat16)
    tokens = mx.random.randint(0, CONFIG["vocab_size"], (8, 1025), key=mx.random.key(rank))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mx.eval(model.parameters(), inputs, targets)

    def loss_fn(m: Any, a: Any, b: Any) -> Any:
        return nn.losses.cross_entropy(m(a).astype(mx.float32), b).mean()

    value_and_grad = nn.value_and_grad(model, loss_fn)
    for variant in variants:
        optimizer = optim.AdamW(1e-5)
        stream = mx.new_stream(mx.gpu) if "stream" in variant else None
        times = []
        for _ in range(steps):
            mx.synchronize()
            t = time.perf_counter()
            loss, grads = value_and_grad(model, inputs, targets)
            if n > 1 and variant.startswith("mlx"):
                grads = nn.average_gradients(grads)
            elif n > 1:
                grads, reduced = buckets_reduced(grads, n, "rev" in variant, stream, 32 if "b32" in variant else 64)
                if "order" in variant:
                    mx.async_eval(reduced)
            optimizer.update(model, grads)
            mx.eval(loss, model.parameters(), optimizer.state)
            times.append(time.perf_counter() - t)
        if rank == 0:
            median, fastest = statistics.median(times[3:]) * 1e3, min(times[3:]) * 1e3
            print(json.dumps({"world_size": n, "variant": variant, "median_ms": round(median, 2),
                              "min_ms": round(fastest, 2)}), flush=True)


if __name__ == "__main__":
    main()
