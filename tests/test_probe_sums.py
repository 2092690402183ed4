"""The probe's sums over the ranks (``harness.rank.defects``), in one process: the packing and
unpacking of ``sum_over_ranks`` (a group of one sums nothing, so every value must come back as it
went), and the dtypes a rank hands over whatever its micro-batch count (every rank must lay the
same leaves end to end). Real ranks: ``tests/test_step_probe.py`` counts the sums in their ledgers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map

from harness.rank import defects


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16)

    def __call__(self, x: mx.array) -> mx.array:
        return self.out(self.embed(x))


def test_sums_come_back_in_their_trees_shapes_and_dtypes_a_bucket_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    group = mx.distributed.init()  # one process: a sum over it is its input
    issued = []
    real = mx.distributed.all_sum
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, **kw: issued.append((x.dtype, x.size)) or real(x, **kw))
    monkeypatch.setattr(defects, "BUCKET_BYTES", 48)  # 12 float32s a sum
    key = mx.random.key(3)
    trees = [mx.array(2.5), {"a": [mx.random.normal((3, 4), key=key), mx.arange(5, dtype=mx.bfloat16)],
                             "b": {"c": mx.random.normal((2,), key=key)}}, mx.ones((7,), dtype=mx.bfloat16)]
    out = defects.sum_over_ranks(trees, world_size=2, group=group)
    for before, after in zip(trees, out, strict=True):
        flat_b, flat_a = tree_flatten(before), tree_flatten(after)
        assert [k for k, _ in flat_b] == [k for k, _ in flat_a]
        for (_, x), (_, y) in zip(flat_b, flat_a, strict=True):
            assert x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y).item()
    # float32: 1, then 12 (the 48 bytes a sum may carry), then 2; bfloat16: 5 + 7 in one
    assert issued == [(mx.float32, 1), (mx.float32, 12), (mx.float32, 2), (mx.bfloat16, 12)], issued
    assert defects.sum_over_ranks(trees, world_size=1) is trees


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_rank_without_micro_batches_hands_over_the_dtypes_the_others_do(dtype: mx.Dtype) -> None:
    model = Tiny()
    model.set_dtype(dtype)
    x = mx.array([[1, 2, 3, 4]])
    micro = (x, mx.array([[2, 3, 4, 5]]), mx.ones_like(x))
    with_rows, without = defects._pieces(model, [micro]), defects._pieces(model, [])
    for a, b in zip(with_rows, without, strict=True):
        def kinds(t: object) -> list:
            return [(k, v.dtype, v.shape) for k, v in tree_flatten(t)]

        assert kinds(a) == kinds(b)


def test_a_rank_without_supervised_tokens_adds_zero_to_the_per_rank_means() -> None:
    """Its own token count divides as max(T_r, 1) (the reference's mean_of_means mutation does):
    its per-rank means are 0, where 0/0 made them NaN."""
    model = Tiny()
    x = mx.array([[1, 2, 3, 4]])
    unsupervised = (x, mx.array([[2, 3, 4, 5]]), mx.zeros_like(x))
    found = defects.hypotheses(model, [unsupervised], rank=0, world_size=1)
    for name in ("mean_of_means", "not_divided_by_world", "no_allreduce", "same_rows"):
        loss, grads, tokens = found[name]
        assert loss.item() == 0.0 and tokens.item() == 0.0, name
        assert all(mx.all(g == 0).item() for _, g in tree_flatten(grads)), name
    ref = {"loss": 0.0, "grads": dict(tree_flatten(model.trainable_parameters()))}
    zero = mx.array(0.0)
    figures = defects.measure(found, zero, tree_map(mx.zeros_like, model.trainable_parameters()), 0, ref)
    assert figures["no_allreduce"]["loss_rel"] == 0.0  # a loss of 0 where 0 is predicted matches
