"""What a run's speed was measured under: other processes on its CPUs (``cpu_use``) and the time
it queued for rank slots (``queued_s``), marked in the run table and said below it."""

from __future__ import annotations

from typing import Any

from harness.controller.cpu_use import CpuUse

MARK = "*"
QUEUE_NOTE_S = 1.0  # a shorter wait is not worth a line


def disturbed(run: dict[str, Any]) -> CpuUse | None:
    """The run's CPU use when other processes took more than the cores it left free, else None."""
    c = run.get("cpu_use")
    if not run.get("ok") or not c:
        return None
    use = CpuUse(int(c["cores"]), float(c["wall_s"]), float(c["busy_s"]), float(c["own_s"]))
    return use if use.disturbed(int(run["world_size"])) else None


def condition_notes(scenario: dict[str, Any]) -> list[str]:
    notes = []
    for r in scenario["runs"]:
        use = disturbed(r)
        if use is not None:
            notes.append(f"{MARK} run {r['name']}: measured while {use.describe()} (its {r['world_size']} "
                         f"rank{'s' if r['world_size'] != 1 else ''} left {max(0, use.cores - r['world_size'])} "
                         f"free): its speed is not comparable with a quiet run's")
        if (r.get("queued_s") or 0) >= QUEUE_NOTE_S:
            notes.append(f"run {r['name']} waited {r['queued_s']:.1f} s for this machine's rank slots before it "
                         f"started (other launches held them)")
    return notes
