"""Checks: each turns collected runs into a pass/fail with its measured value and its limit.

Every check here can fail: it compares figures the ranks measured against a limit from the
scenario, and a run that is missing its figures fails the check rather than skipping it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from harness.controller.collect import RunOutcome
from harness.scenario import Scenario

MB = 1024 * 1024


@dataclass
class Check:
    name: str
    run: str
    passed: bool
    value: float | int | None
    limit: float | int | None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _max_abs_delta(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def loss_parity(run: RunOutcome, ref: RunOutcome, tol: float) -> Check:
    """Per-step global loss of ``run`` vs the reference run: max |delta| <= tol."""
    a, b = run.result().get("losses", []), ref.result().get("losses", [])
    d = _max_abs_delta(a, b)
    worst = max(range(len(a)), key=lambda i: abs(a[i] - b[i])) + 1 if len(a) == len(b) and a else None
    detail = f"{len(a)} vs {len(b)} steps; worst at step {worst}" if worst else f"{len(a)} vs {len(b)} steps"
    return Check("loss_parity", run.name, d <= tol, d, tol, f"vs {ref.name}: {detail}")


def param_parity(run: RunOutcome, ref: RunOutcome, tol: float) -> Check:
    """Final parameters (rank 0) vs the reference's: max |delta| over every element <= tol."""
    import numpy as np

    if run.params is None or ref.params is None:
        return Check("param_parity", run.name, False, None, tol, "final parameters missing")
    if run.params.keys() != ref.params.keys():
        diff = sorted(run.params.keys() ^ ref.params.keys())
        return Check("param_parity", run.name, False, None, tol, f"parameter names differ: {diff[:3]}")
    worst, where = 0.0, ""
    for k in sorted(run.params):
        a, b = run.params[k], ref.params[k]
        if a.shape != b.shape:
            return Check("param_parity", run.name, False, None, tol, f"{k}: shape {a.shape} vs {b.shape}")
        d = float(np.max(np.abs(a - b))) if a.size else 0.0
        if d > worst or not where:
            worst, where = d, k
    return Check("param_parity", run.name, worst <= tol, worst, tol, f"vs {ref.name}; worst in {where}")


def replica_consistency(run: RunOutcome) -> Check:
    """Every rank's parameter digest is identical at every step that recorded one."""
    per_rank = [o.result.get("digests", {}) if o.result else {} for o in run.ranks]
    steps = sorted(set().union(*per_rank), key=int)
    bad = [s for s in steps if len({d.get(s) for d in per_rank}) != 1]
    if not steps:
        return Check("replica_consistency", run.name, False, None, 0, "no digests recorded")
    detail = f"{run.world_size} ranks at steps {', '.join(steps)}"
    if bad:
        detail += f"; differ at steps {', '.join(bad)}"
    return Check("replica_consistency", run.name, not bad, len(bad), 0, detail)


def token_accounting(run: RunOutcome, ref: RunOutcome | None) -> Check:
    """Ranks' local tokens add up to the global count, which equals the reference's."""
    results = [o.result or {} for o in run.ranks]
    local = sum(int(r.get("tokens_local", 0)) for r in results)
    glob = {int(r.get("tokens_global", -1)) for r in results}
    ok = len(glob) == 1 and local == next(iter(glob))
    detail = f"sum of rank tokens {local}, global {sorted(glob)}"
    if ref is not None and ref is not run:
        ref_tokens = int(ref.result().get("tokens_global", -1))
        ok = ok and ref_tokens in glob
        detail += f", {ref.name} {ref_tokens}"
    return Check("token_accounting", run.name, ok, local, next(iter(glob)) if len(glob) == 1 else None, detail)


def _peaks(run: RunOutcome, key: str) -> list[int]:
    return [int((o.result or {}).get(key, 0)) for o in run.ranks]


def memory_ceilings(run: RunOutcome, s: Scenario) -> list[Check]:
    """Peak RSS and peak MLX memory per rank (the largest rank) and summed over ranks."""
    c = s.checks
    out = []
    for label, key, per_rank, total in (
        ("rss", "rss_peak_bytes", c.max_rss_mb, c.max_total_rss_mb),
        ("mlx", "mlx_peak_bytes", c.max_mlx_mb, c.max_total_mlx_mb),
    ):
        peaks = _peaks(run, key)
        mbs = ", ".join(f"{p / MB:.1f}" for p in peaks)
        if per_rank is not None:
            v = max(peaks) / MB
            out.append(Check(f"memory_{label}_per_rank_mb", run.name, v <= per_rank, round(v, 2), per_rank,
                             f"per rank: {mbs}"))
        if total is not None:
            v = sum(peaks) / MB
            out.append(Check(f"memory_{label}_total_mb", run.name, v <= total, round(v, 2), total,
                             f"sum of {run.world_size} ranks"))
    return out


def judge(s: Scenario, runs: list[RunOutcome]) -> list[Check]:
    """All checks of a scenario whose runs all succeeded."""
    by_name = {r.name: r for r in runs}
    ref = by_name.get(s.checks.reference) if s.checks.reference else None
    checks: list[Check] = []
    for run in runs:
        if ref is not None and run is not ref:
            checks.append(loss_parity(run, ref, s.checks.loss_tolerance))
            checks.append(param_parity(run, ref, s.checks.param_tolerance))
        checks.append(token_accounting(run, ref))
        checks.append(replica_consistency(run))
        checks.extend(memory_ceilings(run, s))
    return checks
