"""The split forward of a noise-floor run (``harness.scenario.runs``'s *split* runs): the model computes
each batch in N row chunks, as N ranks hold them, and each chunk's contribution to every trainable
parameter's gradient is rounded once more in that gradient's own dtype, as N ranks' all-reduce
rounds the sum of their partial gradients; for a trainer whose ranks scale their loss by their own
token count (``SplitFloor.outputs``), the gradient of each chunk's output is carried at that rank's
scale once, in its dtype, as the rank computes it (``rank_scaled_outputs``). Used by the external
trainers' adapters and by a script's session (``harness.api``).

What the floor changes is what data parallelism changes, and no more: the batch shapes the kernels
see, the grouping of the gradient's sum into per-rank partial sums, and the rounding of that sum in
the dtype the gradients are reduced in. Where the ranks scale their loss as one process does (a sum
over the global token count), it leaves the activations' gradients alone: each rank computes each
row's loss gradient as one process does, so rounding those (in the model's dtype, 2^-8 for bfloat16)
would make a floor far larger than any correct run's deviation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from harness.scenario.job import TrainJob


def chunk_rows(rows: int, n: int) -> list[list[int]]:
    """``rows`` rows dealt into ``n`` chunks as most trainers shard a batch (row i to chunk i mod n:
    sizes differ by at most one, none empty), each in ascending order."""
    n = max(1, min(n, rows))
    return [list(range(k, rows, n)) for k in range(n)]


def take_rows(args: tuple[Any, ...], kwargs: dict[str, Any], rows: int, picked: list[int]
              ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A forward call's arguments for the ``picked`` rows, in that order: every array with
    ``rows`` rows is indexed."""
    import mlx.core as mx

    at = mx.array(picked)

    def cut(v: Any) -> Any:
        return v[at] if isinstance(v, mx.array) and v.ndim and v.shape[0] == rows else v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


@dataclass(frozen=True)
class SplitFloor:
    """A split floor run's plan (``rows`` chunks; ``sample``: which of its rounding samples),
    from the job (``split_floor``)."""

    rows: int
    sample: int = 0
    seed: int = 0
    outputs: bool = False  # round each chunk's output gradient too (its ranks scale their own loss)


def split_floor(job: TrainJob, seed: int, outputs: bool | None = None) -> SplitFloor | None:
    """The job's split floor plan; None outside a split floor run. ``outputs``: whether the
    ranks scale their own loss (default: as the trainer's record says, ``rank_loss_scale``)."""
    from harness.scenario.trainers import trainer_info

    rows = job.split_rows
    if outputs is None:
        outputs = trainer_info(job.scenario.trainer.kind).rank_loss_scale is not None
    return SplitFloor(rows, job.split_sample, seed, outputs) if rows > 1 else None


def rounded_gradient(x: Any, key: Any) -> Any:
    """``x`` itself; its gradient rounded once more in its own dtype: every element times 1 +- u/2
    (u the dtype's unit in the last place), computed in float32 and rounded back, the signs drawn
    from ``key`` (an explicit key: MLX's global RNG is not touched)."""
    import mlx.core as mx

    @mx.custom_function
    def same(y: Any) -> Any:
        return y

    @same.vjp
    def _(primals: Any, cotangent: Any, output: Any) -> Any:
        half = float(mx.finfo(cotangent.dtype).eps) / 2
        signs = mx.random.bernoulli(0.5, cotangent.shape, key=key).astype(mx.float32) * 2 - 1
        return ((cotangent.astype(mx.float32) * (1 + half * signs)).astype(cotangent.dtype),)

    return same(x)


def rank_scaled_outputs(x: Any, sizes: list[int]) -> Any:
    """``x`` itself (the chunks' outputs, concatenated: ``sizes`` rows each); its gradient carried
    at each chunk's own loss scale once, as a rank that divides its loss by its own token count
    computes it: chunk k's gradient times T / n_k (n_k the positions it supervises, those whose
    gradient is not all zero; T the call's), rounded in its dtype, and divided back. Where T / n_k
    is a power of two (equal shares of 2 or 4 ranks) that is exact, as it is on the ranks;
    otherwise the division rounds once more than a rank does."""
    import mlx.core as mx

    @mx.custom_function
    def same(y: Any) -> Any:
        return y

    @same.vjp
    def _(primals: Any, cotangent: Any, output: Any) -> Any:
        bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
        parts = [cotangent[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        supervised = [(p != 0).reshape(p.shape[0], -1, p.shape[-1]).any(axis=-1).sum().astype(mx.float32)
                      for p in parts]
        total = sum(supervised[1:], supervised[0])
        scaled = []
        for p, n in zip(parts, supervised, strict=True):
            r = total / mx.maximum(n, 1)
            own = (p.astype(mx.float32) * r).astype(p.dtype)  # the rank's gradient, rounded at its scale
            scaled.append((own.astype(mx.float32) / r).astype(p.dtype))
        return (mx.concatenate(scaled, axis=0),)

    return same(x)


@contextmanager
def rounded_parameter_gradients(module: Any, key: Any) -> Iterator[None]:
    """Within it, ``module``'s trainable parameters are ``rounded_gradient`` identities of
    themselves (a key each, split from ``key``): the gradient one call contributes to each is
    rounded once more. The parameters themselves are put back on leaving."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    flat = tree_flatten(module.trainable_parameters())
    if not flat:
        yield
        return
    keys = mx.random.split(key, len(flat))
    module.update(tree_unflatten([(name, rounded_gradient(p, keys[i])) for i, (name, p) in enumerate(flat)]))
    try:
        yield
    finally:
        module.update(tree_unflatten(flat))


def split_forward(model: Any, plan: SplitFloor, take: Any = take_rows) -> None:
    """A split floor run of an external trainer: the model's forward computes each batch in
    ``plan.rows`` chunks of rows (``chunk_rows``: the shapes of that many ranks' batches, each
    parameter's gradient summed from that many partial products as the ranks' all-reduce sums
    them), each chunk's gradient contribution to every trainable parameter rounded once more in its
    dtype (``rounded_parameter_gradients``, a key per call and chunk from the seed and
    ``plan.sample``: each sample another draw of that rounding; a float32 gradient's upper draw,
    1 + 2^-24, rounds to 1, so there only the lower draws move it), with ``plan.outputs`` the gradient
    of each chunk's output carried at its rank's loss scale (``rank_scaled_outputs``), and returns
    the logits of every row in the original order: the same
    mathematics as one forward on the whole batch, only its rounding differs. ``take(args, kwargs,
    rows, picked)`` cuts a call's arguments. The class is swapped, so the parameter tree keeps its
    names."""
    import mlx.core as mx

    base = type(model)
    calls = [0]

    def call(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        plan = type(self).split_plan  # ``rounded_outputs`` may turn its output rounding on after the split
        rows = inputs.shape[0]
        chunks = chunk_rows(rows, plan.rows)
        calls[0] += 1
        keys = mx.random.split(mx.random.key((plan.seed * 1000 + plan.sample) * 1_000_003 + calls[0]), len(chunks))
        outs = []
        for k, picked in enumerate(chunks):
            a, kw = take((inputs, *args), kwargs, rows, picked)
            with rounded_parameter_gradients(self, keys[k]):
                out = getattr(out := base.__call__(self, *a, **kw), "logits", out)
            outs.append(out)
        where = [0] * rows  # row i's position in the chunks' concatenation
        for at, i in enumerate(i for picked in chunks for i in picked):
            where[i] = at
        joined = mx.concatenate(outs, axis=0)
        if plan.outputs:
            joined = rank_scaled_outputs(joined, [len(picked) for picked in chunks])
        return joined[mx.array(where)]

    model.__class__ = type(f"Split{base.__name__}", (base,), {"__call__": call, "split_floor": True,
                                                               "split_plan": plan})


def is_split(model: Any) -> bool:
    """Whether ``model`` (or its transformer body) computes split already (``split_forward``)."""
    return any(getattr(type(m), "split_floor", False) for m in (model, getattr(model, "model", None)))


def rounded_outputs(model: Any) -> None:
    """A model split already (``split_text_model``) rounds each chunk's output gradient too from now on."""
    import dataclasses

    for m in (model, getattr(model, "model", None)):
        if getattr(type(m), "split_floor", False):
            type(m).split_plan = dataclasses.replace(type(m).split_plan, outputs=True)


def split_text_model(model: Any, plan: SplitFloor) -> Any:
    """``split_forward`` on a text model's transformer body (``model.model`` in mlx-lm's models),
    so that trainers which compute their loss from the hidden states (a fused cross-entropy that
    never calls the whole model) are split too; returns ``model``."""
    split_forward(getattr(model, "model", model), plan)
    return model
