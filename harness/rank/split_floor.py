"""The split forward of a noise-floor run (``harness.scenario.runs``'s *split* runs): the model computes
each batch in N row chunks, each chunk's rows in reverse order, and the gradient of its output is
rounded once more, as N ranks compute it. Used by the external trainers' adapters and by a
script's session (``harness.api``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.scenario.job import TrainJob


def chunk_rows(rows: int, n: int) -> list[list[int]]:
    """``n`` contiguous chunks of ``rows`` rows (sizes differ by at most one; none empty), each
    listed in reverse order."""
    n = max(1, min(n, rows))
    cuts = [rows * k // n for k in range(n + 1)]
    return [list(range(stop - 1, start - 1, -1)) for start, stop in zip(cuts[:-1], cuts[1:], strict=True)]


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


def split_floor(job: TrainJob, seed: int) -> SplitFloor | None:
    """The job's split floor plan; None outside a split floor run."""
    rows = job.split_rows
    return SplitFloor(rows, job.split_sample, seed) if rows > 1 else None


def rounded_gradient(x: Any, key: Any) -> Any:
    """``x`` itself; its gradient rounded once more, as each rank's own loss rounds it: every
    element times 1 +- u/2 (u the dtype's unit in the last place), the signs drawn from ``key``
    (an explicit key: MLX's global RNG is not touched)."""
    import mlx.core as mx

    @mx.custom_function
    def same(y: Any) -> Any:
        return y

    @same.vjp
    def _(primals: Any, cotangent: Any, output: Any) -> Any:
        half = float(mx.finfo(cotangent.dtype).eps) / 2
        signs = mx.random.bernoulli(0.5, cotangent.shape, key=key).astype(cotangent.dtype) * 2 - 1
        return (cotangent * (1 + half * signs),)

    return same(x)


def split_forward(model: Any, plan: SplitFloor, take: Any = take_rows) -> None:
    """A split floor run of an external trainer: the model's forward computes each batch in
    ``plan.rows`` contiguous chunks of rows, each with its rows in reverse order (the shapes of
    that many ranks' batches, the gradient summed from that many partial products as the ranks
    sum it, and another summation order inside each), and returns the logits of every row in the
    original order, their gradient rounded once more (``rounded_gradient``, a key per call from
    the seed and ``plan.sample``), as each rank's own loss rounds it: the same mathematics as one
    forward on the whole batch, only its rounding differs. ``take(args, kwargs, rows, picked)``
    cuts a call's arguments. The class is swapped, so the parameter tree keeps its names."""
    import mlx.core as mx

    base = type(model)
    calls = [0]

    def call(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        rows = inputs.shape[0]
        outs = []
        for picked in chunk_rows(rows, plan.rows):
            a, kw = take((inputs, *args), kwargs, rows, picked)
            out = base.__call__(self, *a, **kw)
            outs.append(getattr(out, "logits", out)[::-1])
        calls[0] += 1
        key = mx.random.key((plan.seed * 1000 + plan.sample) * 1_000_003 + calls[0])
        return rounded_gradient(mx.concatenate(outs, axis=0), key)

    model.__class__ = type(f"Split{base.__name__}", (base,), {"__call__": call})


def split_text_model(model: Any, plan: SplitFloor) -> Any:
    """``split_forward`` on a text model's transformer body (``model.model`` in mlx-lm's models),
    so that trainers which compute their loss from the hidden states (a fused cross-entropy that
    never calls the whole model) are split too; returns ``model``."""
    split_forward(getattr(model, "model", model), plan)
    return model
