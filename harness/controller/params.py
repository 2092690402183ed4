"""A run's final parameters as the judge compares them: read from a rank's parameter file, their
distance from another run's, and how far training moved them.

LoRA adapters are compared by the weight update they make, not factor by factor: a layer's
``lora_a`` (in x r) and ``lora_b`` (r x out) enter the model only as their product, which any
invertible change of basis of the rank dimension leaves as it is. AdamW's rounding drifts the
factors along that freedom (a correct 2-rank mlx-lm LoRA run's factors ended 24 % apart from one
process's after 20 steps in float32, while its loss stayed within 7e-4), so a comparison of the
factors measures the freedom, not the training. Every other parameter is compared element by
element.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LORA = (".lora_a", ".lora_b")
PRODUCT_ELEMENTS = 1 << 22  # a larger product's distance is taken from r x r traces (no largest element)
CHUNK = 1 << 20  # the elements of a tensor compared at once


def load_stored(path: Path) -> tuple[dict[str, Any] | None, float | None]:
    """A parameter file's arrays in float32, and the unit roundoff of the coarsest floating dtype
    they are stored in (None: no file, or none floating)."""
    if not path.exists():
        return None, None
    import mlx.core as mx
    import numpy as np

    arrays = mx.load(str(path))
    units = [float(mx.finfo(v.dtype).eps) / 2 for v in arrays.values() if mx.issubdtype(v.dtype, mx.floating)]
    return {k: np.array(v.astype(mx.float32)) for k, v in arrays.items()}, max(units, default=None)


def _parts(params: dict[str, Any]) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(label, keys) per compared part: a LoRA layer's factor pair as one (2-D factors, ``lora_a``
    in x r and ``lora_b`` r x out, as mlx-lm's ``LoRALinear`` holds them), every other tensor alone
    (an expert-stacked pair of an MoE layer too)."""
    paired = set()
    for k in sorted(params):
        a, b = params[k], params.get(k[: -len(LORA[0])] + LORA[1]) if k.endswith(LORA[0]) else None
        if b is not None and a.ndim == b.ndim == 2 and a.shape[1] == b.shape[0]:
            paired |= {k, k[: -len(LORA[0])] + LORA[1]}
            yield k[: -len(LORA[0])] + ".lora_a @ lora_b", (k, k[: -len(LORA[0])] + LORA[1])
    for k in sorted(params.keys() - paired):
        yield k, (k,)


def _tensor_gaps(x: Any, y: Any) -> tuple[float, float, float]:
    """``_gaps`` of one tensor, in float64 a slice of ``CHUNK`` elements at a time: the sums of whole
    float64 copies (to about 1e-14, summed in another order), without making the copies (a
    0.5B-parameter model's would be 4 GB each)."""
    import numpy as np

    x, y = x.reshape(-1), y.reshape(-1)
    diff = norm = big = 0.0
    for i in range(0, x.size, CHUNK):
        b = y[i:i + CHUNK].astype(np.float64)
        d = x[i:i + CHUNK].astype(np.float64) - b
        diff, norm = diff + float(d @ d), norm + float(b @ b)
        big = max(big, float(np.max(np.abs(d))))  # a NaN in d: param_delta stops at the sums, also NaN
    return diff, norm, big


def _gaps(x: tuple[Any, ...], y: tuple[Any, ...]) -> tuple[float, float, float | None]:
    """||x - y||^2, ||y||^2 and the largest |x - y| element of one part (a factor pair: of its product)."""
    import numpy as np

    if len(x) == 1:
        return _tensor_gaps(x[0], y[0])
    x, y = tuple(v.astype(np.float64) for v in x), tuple(v.astype(np.float64) for v in y)
    (a1, b1), (a2, b2) = x, y
    if a1.shape[0] * b1.shape[1] <= PRODUCT_ELEMENTS:
        p, q = a1 @ b1, a2 @ b2
        d = p - q
        return float(np.sum(d * d)), float(np.sum(q * q)), float(np.max(np.abs(d))) if d.size else 0.0

    def dot(a: Any, b: Any, c: Any, e: Any) -> float:  # <a b, c e> over every element, from r x r matrices
        return float(np.trace((a.T @ c) @ (e @ b.T)))

    pp, pq, qq = dot(a1, b1, a1, b1), dot(a1, b1, a2, b2), dot(a2, b2, a2, b2)
    return max(pp - 2 * pq + qq, 0.0), qq, None


def param_delta(a: dict[str, Any] | None, b: dict[str, Any] | None) -> tuple[float, float, str] | None:
    """(||a - b|| / ||b|| over every compared part, the largest |a - b| element, its part: a
    LoRA layer's adapters as the product of its factors, the module docstring); None where
    either is missing or they differ in names or shapes; NaN and the first part that is not finite
    where one is not."""

    if a is None or b is None or a.keys() != b.keys():
        return None
    if any(a[k].shape != b[k].shape for k in a):
        return None
    diff = norm = worst = 0.0
    where = ""
    for label, keys in _parts(b):
        d, n, big = _gaps(tuple(a[k] for k in keys), tuple(b[k] for k in keys))
        if not (math.isfinite(d) and math.isfinite(n)):  # a training that diverged: no distance to judge
            return math.nan, math.nan, label
        diff, norm = diff + d, norm + n
        if big is not None and (big > worst or not where):
            worst, where = big, label
    return (diff / norm) ** 0.5 if norm > 0 else 0.0, worst, where


def moved(final: dict[str, Any] | None, start_path: Path) -> float | None:
    """How far training moved rank 0's parameters: ||final - start|| / ||final|| over every
    part of ``final`` (a LoRA run's final parameters are its adapters alone, compared by their
    products); None where rank 0 left no start (only the run others are compared with does:
    ``keep_start`` in its job)."""
    if final is None:
        return None
    start = load_stored(start_path)[0]
    if start is None or not final.keys() <= start.keys():
        return None
    got = param_delta({k: start[k] for k in final}, final)
    return got[0] if got is not None and got[0] > 0 else None
