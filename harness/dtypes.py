"""The floating dtypes a model computes in, by name, and the unit roundoff of each: what a rank
reports it computed in (``harness.rank.precision``) and what the judge derives rounding limits
from (``harness.judge.parity``)."""

from __future__ import annotations

UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}


def coarsest(names: object) -> str | None:
    """Of dtype names (an iterable), the one that rounds coarsest; None for none."""
    return max((n for n in names if n in UNIT_ROUNDOFF), key=UNIT_ROUNDOFF.__getitem__, default=None)
