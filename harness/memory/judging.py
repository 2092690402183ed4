"""Judging a run's memory from its ranks' results (plain records, ``harness.schema``): its peaks
against the scenario's ceilings, and each rank's MLX peak against its share of its machine
(``harness.memory.share``). Each judgement is a ``Measured`` (value and limit in MB); the judge
names it as a check (``harness.judge.memory_checks``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.memory.plan import MB

RSS_FIELDS = ("rss_baseline", "rss_baseline_bytes", "rss_peak_after_baseline_bytes")
NO_SHARE = ("the ranks recorded no memory share (an executable under [trainer] kind = \"command\" is its own "
            "process, whose memory limits the harness cannot see)")


@dataclass(frozen=True)
class Measured:
    """One judgement of memory: passed, the value and limit (MB), what was measured; not
    ``applicable`` where there was nothing to hold to a limit."""

    passed: bool
    value: float | None
    limit: float | None
    detail: str
    applicable: bool = True


def _mb(n: float) -> str:
    return f"{n / MB:.1f} MB"


def _missing(ranks: list[tuple[int, dict[str, Any]]], keys: tuple[str, ...]) -> list[str]:
    """"rank R key" for each of ``keys`` a rank lacks (or holds as null)."""
    return [f"rank {rank} {k}" for rank, r in ranks for k in keys if r.get(k) is None]


def ceilings(ranks: list[tuple[int, dict[str, Any]]], label: str, per_rank: float | None,
             total: float | None, ranks_line: str) -> tuple[Measured | None, Measured | None]:
    """The largest rank's and the ranks' summed peak of ``label`` ("rss": RSS above each rank's
    baseline; "mlx": MLX's own count of its buffers, the device figure on every device) against
    the per-rank and total ceilings (None: not judged); a rank lacking a figure fails both,
    naming it. ``ranks``: (rank, its result); ``ranks_line``: "2 ranks"."""
    if per_rank is None and total is None:
        return None, None
    keys = RSS_FIELDS if label == "rss" else ("mlx_peak_bytes",)
    missing = _missing(ranks, keys)
    if missing:
        lost = f"not reported: {', '.join(missing)}"
        return tuple(None if limit is None else Measured(False, None, limit, lost)  # type: ignore[return-value]
                     for limit in (per_rank, total))
    results = [r for _, r in ranks]
    where = ""
    if label == "rss":
        peaks = [int(r["rss_peak_after_baseline_bytes"]) - int(r["rss_baseline_bytes"]) for r in results]
        bases = [f"{int(r['rss_baseline_bytes']) / MB:.0f}" for r in results]
        kinds = {str(r["rss_baseline"]) for r in results}
        where = (f" above the RSS baseline ({kinds.pop()}: {', '.join(bases)} MB)" if len(kinds) == 1 else
                 " above the RSS baselines (" + ", ".join(f"{r['rss_baseline']}: {b} MB"
                                                          for r, b in zip(results, bases, strict=True)) + ")")
    else:
        peaks = [int(r["mlx_peak_bytes"]) for r in results]
    out = []
    for per, limit in ((True, per_rank), (False, total)):
        if limit is None:
            out.append(None)
            continue
        v = (max(peaks) if per else sum(peaks)) / MB
        detail = (f"per rank: {', '.join(f'{p / MB:.1f}' for p in peaks)}" if per else f"sum of {ranks_line}") + where
        out.append(Measured(v <= limit, round(v, 2), limit, detail))
    return out[0], out[1]


def within_share(ranks: list[tuple[int, dict[str, Any]]]) -> Measured:
    """The worst rank's MLX peak against its share (value and limit in MB); the detail lists the
    limits its trainer asked for and what it got."""
    rows = [(rank, r.get("memory_share"), r.get("mlx_peak_bytes")) for rank, r in ranks]
    if not any(isinstance(share, dict) for _, share, _ in rows):
        return Measured(True, None, None, f"not applicable: {NO_SHARE}", applicable=False)
    missing = [str(r) for r, share, _ in rows if not isinstance(share, dict)]
    if missing:
        return Measured(False, None, None, f"rank {', '.join(missing)} recorded no memory share")
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
        return Measured(False, None, None, "no rank reported its MLX peak memory; " + detail)
    _, rank, n, limit = worst
    head = "; ".join(over) if over else f"largest: rank {rank} {_mb(n)} of its share {_mb(limit)}"
    return Measured(not over, round(n / MB, 2), round(limit / MB, 2), f"{head}; {detail}")
