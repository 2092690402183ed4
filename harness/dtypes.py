"""The floating dtypes a model computes in, by name, with the unit roundoff and width of each:
what a rank reports it computed in and held its weights in (``harness.rank.precision``), what the
judge derives rounding limits from (``harness.judge.parity``) and tells a widened weight by
(``dtype_held``)."""

from __future__ import annotations

from typing import Any

UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
FLOAT_BITS = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


def dtype_name(a: Any) -> str:
    """An MLX array's dtype by name (``bfloat16``, ``float32``, ...)."""
    return str(a.dtype).rpartition(".")[2]


def coarsest(names: object) -> str | None:
    """Of dtype names (an iterable), the one that rounds coarsest; None for none."""
    return max((n for n in names if n in UNIT_ROUNDOFF), key=UNIT_ROUNDOFF.__getitem__, default=None)
