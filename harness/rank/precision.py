"""The precision a rank computes at, measured on its device: every trainer's result carries it,
and the judge derives its rounding limits from it."""

from __future__ import annotations

from typing import Any

from harness.dtypes import UNIT_ROUNDOFF, coarsest, dtype_name

TF32_SEEN = 2.0**-16  # a float32 matmul rounding its operands coarser than this rounds them to TF32 (2^-11)


def coarsest_dtype(*trees: Any) -> str | None:
    """The floating dtype of coarsest rounding among the arrays of ``trees`` (parameter trees,
    frozen weights included): what a forward and backward through them compute in. A bfloat16
    base under float32 LoRA adapters is a bfloat16 computation. None where no array is floating."""
    return coarsest({d for tree in trees for d in param_dtypes(tree).values()})


def measure_precision(dtype: str, declared: str | None = None) -> dict[str, Any]:
    """The precision this device computes ``dtype`` (the dtype the ranks were seen computing in)
    at: the dtype's unit roundoff, and the largest relative error of multiplying random values by
    the identity matrix, which is exact unless the matmul rounds its operands (TF32 rounds float32
    to 10 mantissa bits). ``declared``: the scenario's ``[model] dtype``, named in the label where
    it is not the dtype seen."""
    import mlx.core as mx
    import numpy as np

    dt = getattr(mx, dtype)
    x = mx.array(np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)).astype(dt)
    y = x @ mx.eye(256, dtype=dt)
    a, b = np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32))
    u_matmul = float(np.max(np.abs(a - b) / np.maximum(np.abs(a), np.finfo(np.float32).tiny)))
    tf32 = dtype == "float32" and u_matmul > TF32_SEEN
    label = f"{dtype}, TF32 matmuls" if tf32 else dtype
    if declared is not None and declared != dtype:
        label += f" (seen in the weights; [model] dtype is {declared})"
    return {"dtype": dtype, "u_dtype": UNIT_ROUNDOFF[dtype], "u_matmul": u_matmul,
            "u_in": max(UNIT_ROUNDOFF[dtype], u_matmul), "device": str(mx.default_device()), "tf32": tf32,
            "label": label, "declared": declared or dtype}


def rank_precision(seen: str, declared: str | None = None) -> dict[str, Any]:
    """A rank's ``precision`` record: what it computed training at (``measure_precision``) and,
    where that is narrower than float32, under ``probe`` what its step-local probes compute at
    (``harness.rank.step_probe.in_float32``)."""
    out = measure_precision(seen, declared)
    if seen != "float32":
        out["probe"] = measure_precision("float32")
    return out


def param_dtypes(tree: Any) -> dict[str, str]:
    """Each array's dtype name by its path in ``tree`` (a parameter tree); no array is read."""
    from mlx.utils import tree_flatten

    return {k: dtype_name(v) for k, v in tree_flatten(tree) if hasattr(v, "dtype")}


def dtype_changes(start: dict[str, str] | None, params: Any, setup_casts: int = 0,
                  shown: int = 5) -> dict[str, Any] | None:
    """The result's ``dtype_changes``: the parameters of ``start`` (``param_dtypes`` where training
    started) that ``params``, the final ones, hold in another dtype (the first ``shown`` as [path,
    start dtype, end dtype]), how many were compared, and how many of the start's dtypes the
    trainer's own setup set (``setup_casts``); None where the start is not known."""
    if start is None:
        return None
    end = param_dtypes(params)
    both = [k for k in end if k in start]
    changed = [[k, start[k], end[k]] for k in both if start[k] != end[k]]
    return {"compared": len(both), "changed_count": len(changed), "changed": changed[:shown],
            "setup_casts": setup_casts}
