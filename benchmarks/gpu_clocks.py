"""The GPU's SM clock, power draw and temperature through a benchmark, read with ``nvidia-smi``.

A sampler runs for a whole invocation (every side alike). Each reading carries nvidia-smi's own
timestamp, turned into ``time.perf_counter``'s scale (the clock ``timed_script.py``'s rows use: on
Linux one monotonic clock for every process), so a run's timed window is matched with what the GPU
did in it however nvidia-smi's output is buffered. GPU 0 in nvidia-smi's order: the benchmark's one
process on a machine of one GPU. Where ``nvidia-smi`` is missing or prints nothing (a CPU or Metal
machine), every window reads as not measured.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from datetime import datetime
from typing import Any

FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu"
PERIOD_MS = 200


def reading(line: str) -> tuple[float, list[float | None]] | None:
    """``(wall-clock seconds, [SM MHz, watts, degrees C])`` from one of nvidia-smi's csv lines (a field
    it cannot read, None); None for a line that is not one."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    for form in ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S"):  # local time, as it prints
        try:
            at = datetime.strptime(parts[0], form).timestamp()
            break
        except ValueError:
            continue
    else:
        return None
    out: list[float | None] = []
    for p in parts[1:]:
        try:
            out.append(float(p))
        except ValueError:
            out.append(None)  # "[N/A]", "[Not Supported]"
    return (at, out) if any(v is not None for v in out) else None


def summary(samples: list[tuple[float, list[float | None]]], t0: float, t1: float) -> list[float]:
    """Mean SM MHz, mean watts and highest degrees C over the readings stamped in ``[t0, t1]``; empty
    where there are none (or none of a field: then the fields after it are left out too)."""
    inside = [r for t, r in samples if t0 <= t <= t1]
    out: list[float] = []
    for i, pick in enumerate((statistics.fmean, statistics.fmean, max)):
        values = [r[i] for r in inside if r[i] is not None]
        if not values:
            break
        out.append(pick(values))
    return out


class GpuClocks:
    """``with GpuClocks() as g: ...; g.over(t0, t1)`` (``summary`` of GPU 0's readings)."""

    def __init__(self, read: bool = True, tool: str = "nvidia-smi", gpu: int = 0):
        self.tool, self.gpu = shutil.which(tool) if read else None, gpu
        self.samples: list[tuple[float, list[float | None]]] = []
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self._offset = 0.0

    def __enter__(self) -> GpuClocks:
        if self.tool:
            self._offset = time.time() - time.perf_counter()  # wall clock -> perf_counter's scale
            line_buffered = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []  # readings as they are taken
            self._proc = subprocess.Popen(
                [*line_buffered, self.tool, f"--id={self.gpu}", f"--query-gpu={FIELDS}",
                 "--format=csv,noheader,nounits", f"--loop-ms={PERIOD_MS}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            if (r := reading(line)) is not None:
                self.samples.append((r[0] - self._offset, r[1]))

    def over(self, t0: float, t1: float) -> list[float]:
        return summary(list(self.samples), t0, t1)

    def __exit__(self, *exc: Any) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()
