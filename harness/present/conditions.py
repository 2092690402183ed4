"""What a run's speed was measured under: other processes on its CPUs or other launches on its GPU
(``cpu_use.speed_disturbed``) and the time it queued for rank slots (``queued_s``), marked in the
run table and said below it."""

from __future__ import annotations

from typing import Any

from harness.controller.cpu_use import CpuUse, speed_disturbed
from harness.controller.rank_budget import Neighbours

MARK = "*"
QUEUE_NOTE_S = 1.0  # a shorter wait is not worth a line


def disturbed(run: dict[str, Any]) -> str | None:
    """What disturbed a completed run's speed (``speed_disturbed``), else None."""
    if not run.get("ok"):
        return None
    c, n = run.get("cpu_use"), run.get("neighbours")
    cpu = CpuUse(int(c["cores"]), float(c["wall_s"]), float(c["busy_s"]), float(c["own_s"])) if c else None
    near = Neighbours(int(n["samples"]), int(n["shared"]), int(n["most"])) if n else None
    accelerator = next((rk.get("accelerator") for rk in run.get("ranks") or [] if rk.get("accelerator")), None)
    return speed_disturbed(int(run["world_size"]), cpu, near, accelerator)


def condition_notes(scenario: dict[str, Any]) -> list[str]:
    notes = []
    for r in scenario["runs"]:
        why = disturbed(r)
        if why is not None:
            notes.append(f"{MARK} run {r['name']}: measured while {why}: its speed is not comparable with a "
                         f"quiet run's")
        if (r.get("queued_s") or 0) >= QUEUE_NOTE_S:
            notes.append(f"run {r['name']} waited {r['queued_s']:.1f} s for this machine's rank slots before it "
                         f"started (other launches held them)")
    return notes
