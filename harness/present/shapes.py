"""Batch shapes a device is known to train slowly, measured; the throughput table's width cell
and its warnings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SlowWidth:
    """On ``accelerator``, an input width that is not a multiple of ``multiple`` trains at about
    ``speed`` of the next multiple's speed (``measured``: where and how)."""

    accelerator: str
    multiple: int
    speed: str
    measured: str


SLOW_WIDTHS = (
    SlowWidth("cuda", 32, "half",
              "a bf16 0.44B qwen3 step of 8 rows on an H200, mlx 0.32.4: 1023 inputs 30.5k tok/s eager, "
              "1024 inputs 63.9k"),
)


def width_cell(run: dict[str, Any]) -> str:
    """The padded input widths a run trained at: ``1024`` or ``96-160``; ``-`` when not reported."""
    widths = run.get("input_widths") or []
    if not widths:
        return "-"
    lo, hi = min(widths), max(widths)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def width_warnings(scenario: dict[str, Any]) -> list[str]:
    """One line per run that trained at a width its device is known to run slowly."""
    lines = []
    for r in scenario["runs"]:
        for slow in SLOW_WIDTHS:
            odd = sorted({w for w in r.get("input_widths") or [] if w % slow.multiple})
            if r.get("accelerator") == slow.accelerator and odd:
                shown = ", ".join(map(str, odd[:4])) + (", ..." if len(odd) > 4 else "")
                lines.append(f"run {r['name']}: input widths {shown} are not multiples of {slow.multiple}; on "
                             f"{slow.accelerator} such a width trains at about {slow.speed} the speed of the next "
                             f"multiple ({slow.measured}): set [train] pad_to = {slow.multiple}")
    return lines
