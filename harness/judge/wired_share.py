"""``wired_share``: no rank holds more than its share of its machine's memory.

Each Python rank records its share (the memory budget, or its host's working set, divided by the
ranks on its host) and every MLX memory limit set in it (``harness.memory.share``, which
caps each at the share). A rank fails the check when its MLX peak memory (MLX's own count of its
buffers) passed its share; the detail lists the limits its trainer asked for and what it got.
"""

from __future__ import annotations

from harness.controller.outcome import RunOutcome
from harness.judge.checks import MB, Check
from harness.scenario.checks import CheckName

NO_SHARE = ("the ranks recorded no memory share (an executable under [trainer] kind = \"command\" is its own "
            "process, whose memory limits the harness cannot see)")


def _mb(n: float) -> str:
    return f"{n / MB:.1f} MB"


def wired_share(run: RunOutcome) -> Check:
    """The worst rank's held figure against its share (value and limit in MB)."""
    rows = [(o.rank, (o.result or {}).get("memory_share"), (o.result or {}).get("mlx_peak_bytes")) for o in run.ranks]
    if not any(isinstance(share, dict) for _, share, _ in rows):
        return Check(CheckName.wired_share, run.name, True, None, None, f"not applicable: {NO_SHARE}", applicable=False)
    missing = [str(r) for r, share, _ in rows if not isinstance(share, dict)]
    if missing:
        return Check(CheckName.wired_share, run.name, False, None, None,
                     f"rank {', '.join(missing)} recorded no memory share")
    over: list[str] = []
    worst: tuple[float, int, int, int] | None = None  # (ratio, rank, bytes, share)
    calls = 0
    asked = ""
    for rank, share, peak in rows:
        limit = int(share["share_bytes"])
        held = [(f"MLX peak memory {_mb(int(peak))}", int(peak))] if peak is not None else []
        for c in share["calls"]:
            calls += 1
            if calls == 1:
                asked = f"{c['function']} from {c['caller']} asked {_mb(c['asked'])}, set {_mb(c['set'])}"
        for what, n in held:
            if n > limit:
                over.append(f"rank {rank}: {what} above its share {_mb(limit)}")
            ratio = n / limit if limit else float("inf")
            if worst is None or ratio > worst[0]:
                worst = (ratio, rank, n, limit)
    first = next(s for _, s, _ in rows if isinstance(s, dict))
    basis = (f"share = {_mb(first['budget_bytes'])} budget ({first['budget_source']})" if first["budget_bytes"]
             else f"share = {_mb(first['working_set_bytes'])} working set ({first['working_set_source']})")
    detail = (f"{basis} / {first['ranks_on_host']} ranks on the host; {calls} limit call(s) recorded"
              + (f" (first: {asked})" if asked else ""))
    if worst is None:
        return Check(CheckName.wired_share, run.name, False, None, None,
                     "no rank reported its MLX peak memory; " + detail)
    _, rank, n, limit = worst
    head = "; ".join(over) if over else f"largest: rank {rank} {_mb(n)} of its share {_mb(limit)}"
    return Check(CheckName.wired_share, run.name, not over, round(n / MB, 2), round(limit / MB, 2), f"{head}; {detail}")
