"""The fused step's snapshot of the state (``LocalStep.full``): kept wherever a failure could need
it, and left out on a rank without peers whose call reuses a trace that was built before."""

from __future__ import annotations

from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")


class Toy(nn.Module):
    """Embedding and a head; a forward wider than 4 inputs evaluates an array, which a compiled
    call cannot trace (eager, it runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16)

    def __call__(self, x: Any) -> Any:
        h = self.emb(x)
        if x.shape[1] > 4:
            h.sum().item()
        return self.out(h)


def _step(alone: bool, dtype: str = "float32") -> Any:
    from harness.rank.optimizer import build_optimizer
    from harness.scenario import TrainSpec
    from harness.trainers.reference.semantics import Semantics
    from harness.trainers.reference.step import LocalStep

    spec = TrainSpec(steps=4, global_batch=2, learning_rate=1e-2, compile="best_effort")
    model = Toy()
    model.update(nn.utils.tree_map(lambda a: mx.random.normal(a.shape, key=mx.random.key(3)), model.parameters()))
    model.set_dtype(getattr(mx, dtype))
    return LocalStep(model, build_optimizer(spec), spec, Semantics(1, 1, 0), alone=alone)


def _batch(width: int) -> dict[str, Any]:
    ids = mx.arange(2 * (width + 1)).reshape(2, width + 1) % 16
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:], "mask": mx.ones((2, width))}


def _train(runner: Any, width: int) -> Any:
    loss, norm = runner.full(_batch(width), mx.array(0.5, dtype=mx.float32), None)
    snapshot = runner._before is not None
    runner.settled()
    mx.eval(runner.model.state, runner.optimizer.state, loss, norm)
    return snapshot, loss.item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rank_without_peers_snapshots_only_a_call_that_traces_and_trains_the_same(dtype: str) -> None:
    from mlx.utils import tree_flatten

    alone, with_peers = _step(alone=True, dtype=dtype), _step(alone=False, dtype=dtype)
    got = {name: [_train(r, w) for w in (4, 4, 3, 4)] for name, r in (("alone", alone), ("peers", with_peers))}
    # a new input shape traces again: snapshot; a shape built before reuses its trace: none
    assert [s for s, _ in got["alone"]] == [True, False, True, False]
    assert [s for s, _ in got["peers"]] == [True] * 4  # a peer's failure can ask for it at any step
    assert [x for _, x in got["alone"]] == [x for _, x in got["peers"]]
    for (k, a), (_, b) in zip(tree_flatten(alone.model.parameters()), tree_flatten(with_peers.model.parameters()),
                              strict=True):
        assert mx.array_equal(a, b).item(), k


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_failed_trace_at_a_new_shape_is_undone_on_a_rank_without_peers(dtype: str) -> None:
    from mlx.utils import tree_flatten

    from harness.trainers.reference.step import CompileFailed

    runner = _step(alone=True, dtype=dtype)
    _train(runner, 4)
    _train(runner, 4)  # its trace reused: no snapshot taken
    before = [(k, mx.array(v)) for k, v in tree_flatten(runner.model.state)]
    with pytest.raises(CompileFailed):
        runner.full(_batch(6), mx.array(0.5, dtype=mx.float32), None)  # a new shape, whose trace fails
    after = tree_flatten(runner.model.state)
    assert [k for k, _ in after] == [k for k, _ in before]
    for (k, a), (_, b) in zip(after, before, strict=True):  # the state holds no tracer and no update
        assert mx.array_equal(a, b).item(), k
    assert _train(runner, 4)[0] is False  # the built shape still reuses its trace


def test_a_call_at_a_built_shape_that_traces_anew_is_snapshotted_on_a_rank_without_peers() -> None:
    """The fault and the accumulated gradients are part of what a call traces: a built shape with
    either new traces again, so it is snapshotted, and a trace that fails there is undone."""
    from mlx.utils import tree_flatten, tree_map

    from harness.trainers.reference.step import CompileFailed

    runner = _step(alone=True)
    _train(runner, 4)
    before = [(k, mx.array(v)) for k, v in tree_flatten(runner.model.state)]
    with pytest.raises(CompileFailed):  # an injected failure of the trace, at the shape built above
        runner.full(_batch(4), mx.array(0.5, dtype=mx.float32), "compile_error")
    for (k, a), (_, b) in zip(tree_flatten(runner.model.state), before, strict=True):
        assert mx.array_equal(a, b).item(), k
    acc = tree_map(mx.zeros_like, runner.model.trainable_parameters())
    flags = []
    for _ in range(2):  # an accumulating step: a trace of its own, then reused
        loss, norm = runner.full(_batch(4), mx.array(0.5, dtype=mx.float32), None, acc)
        flags.append(runner._before is not None)
        runner.settled()
        mx.eval(runner.model.state, runner.optimizer.state, loss, norm)
    assert flags == [True, False]
