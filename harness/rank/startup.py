"""Where a rank's time goes before its first training step: one clock from the controller's
launch (``job["launched_at"]``) through the rank's start-up parts and the trainer's phases up
to ``train``. Wall-clock seconds (``time.time()``: the launch was stamped by another process)."""

from __future__ import annotations

import time
from typing import Any

# The parts the rank runtime times itself, in order; the trainer's phases ("data", "model",
# "resume", ...) follow, and "trainer" is its set-up before its first phase (its imports).
PARTS = ("spawn", "device", "warm_up", "libraries")


def libraries_loaded(heavy: tuple[str, ...]) -> list[str]:
    """Which of ``heavy``, the libraries whose import costs seconds (``TrainerRef.heavy``), this
    process imported (not those marked absent)."""
    import sys

    return [name for name in heavy if sys.modules.get(name) is not None]


def preloaded() -> list[str]:
    """The ``LD_PRELOAD`` libraries mapped into this process, by file name (Linux: the BLAS and
    the ring's yielding library the launch gave the rank; elsewhere, or with none, empty)."""
    import os

    named = os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
    wanted = {os.path.basename(os.path.realpath(p)) for p in named}  # the map names a link's target
    try:
        with open("/proc/self/maps") as f:
            mapped = {os.path.basename(line.split()[-1]) for line in f if "/" in line}
    except OSError:
        return []
    return sorted(wanted & mapped)


class StartupClock:
    """Marks the end of each start-up part; ``phase`` marks the start of a trainer phase."""

    def __init__(self, launched_at: float | None, heavy: tuple[str, ...] = ()) -> None:
        self.last = time.time()
        self.launched_at = launched_at if launched_at is not None else self.last
        self.parts: dict[str, float] = {"spawn": self.last - self.launched_at}
        self.current = "trainer"  # the part running now, once the runtime's own parts are done
        self.training = False
        self.heavy = heavy

    def done(self, part: str) -> None:
        """The rank runtime's part ``part`` (``PARTS``) just ended."""
        now = time.time()
        self.parts[part] = self.parts.get(part, 0.0) + now - self.last
        self.last = now

    def phase(self, name: str) -> None:
        """The trainer enters phase ``name``: the part before it ends. Timing stops at ``train``
        (a resumed or restarted phase after it is training time)."""
        if self.training:
            return
        self.done(self.current)
        self.current = name
        self.training = name == "train"

    def figures(self) -> dict[str, Any]:
        """``startup_parts_s`` (seconds per part, in order) and ``startup_total_s`` (launch to the
        start of training, or to now when the job never trained)."""
        parts = {k: round(v, 4) for k, v in self.parts.items() if v > 0 or k in PARTS}
        return {"startup_parts_s": parts, "startup_total_s": round(sum(self.parts.values()), 4),
                "libraries_loaded": libraries_loaded(self.heavy), "preloaded": preloaded()}
