"""Checks: each turns collected runs into a pass/fail with its measured value and its limit.

Every check here can fail: it compares figures the ranks measured against a limit from the
scenario, and a run that is missing its figures fails the check rather than skipping it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from harness.controller.collect import RunOutcome
from harness.scenario import RunSpec, Scenario

MB = 1024 * 1024


def median_after_first(values: list[float]) -> float | None:
    """Median of a per-step series without step 1 (graph building, first allocations)."""
    tail = values[1:] if len(values) > 1 else values
    return statistics.median(tail) if tail else None


def fastest_after_first(values: list[float]) -> float | None:
    """The largest value of a per-step series without its first step."""
    tail = values[1:] if len(values) > 1 else values
    return max(tail) if tail else None


@dataclass
class Check:
    """One judgement. ``passed`` says whether it counts as a pass; for a check the scenario
    expects to fail (``xfail``: the reason), a measured failure counts as a pass ("xfail") and a
    measured pass does not ("XPASS"). On a run with an injected bug, a failure is the check
    catching it (``caught``). A check that cannot be measured on this run (``applicable`` false,
    for example step-local parity on a run that executed no probe step) is reported as "n/a",
    never as a pass. ``floor`` is the measured noise floor a limit was derived from, and
    ``derivation`` says how the limit was derived."""

    name: str
    run: str
    passed: bool
    value: float | int | None
    limit: float | int | None
    detail: str = ""
    xfail: str | None = None
    floor: float | None = None
    derivation: str = ""
    caught: bool = False
    applicable: bool = True

    @property
    def result(self) -> str:
        if not self.applicable:
            return "n/a"
        if self.caught:
            return "caught"
        if self.xfail is None:
            return "pass" if self.passed else "FAIL"
        return "xfail" if self.passed else "XPASS"

    @property
    def ratio(self) -> float | None:
        """value / floor, for a check judged against a measured floor."""
        if self.floor is None or not isinstance(self.value, int | float):
            return None
        return self.value / self.floor if self.floor > 0 else (0.0 if self.value == 0 else math.inf)

    @property
    def margin(self) -> float:
        """How clearly a failed check failed: value / limit, or infinity for an exact criterion
        (a count or digest that must match, or a limit of 0)."""
        v, lim = self.value, self.limit
        if isinstance(v, int | float) and isinstance(lim, int | float) and lim > 0 and v > lim:
            return v / lim
        return math.inf

    def to_dict(self) -> dict[str, Any]:
        """The check as result.json holds it (an infinite figure, e.g. the ratio to a zero floor, as null)."""
        d = {**asdict(self), "result": self.result, "ratio": self.ratio,
             "margin": self.margin if not self.passed or self.caught else None}
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in d.items()}


def expected_reason(expected: dict[str, Any], check: str, run: str) -> str | None:
    """Why ``check`` is expected to fail in ``run``: a reason for every run, or a table of run
    name -> reason for some runs only."""
    reason = expected.get(check)
    return reason.get(run) if isinstance(reason, dict) else reason


def mark_expected_failures(checks: list[Check], expected: dict[str, Any]) -> None:
    """Turn the checks the scenario expects to fail into xfail (failed) or XPASS (passed)."""
    for c in checks:
        reason = expected_reason(expected, c.name, c.run)
        if reason is not None and c.applicable:
            c.xfail, c.passed = reason, not c.passed
            c.detail += f"; expected to fail: {reason}" if c.passed else \
                f"; expected to fail ({reason}) but passed: remove the marker"


LR_ULPS = 4


def lr_schedule(run: RunOutcome, ref: RunOutcome) -> Check:
    """The optimizer's learning rate at every step equals the reference's: at one global batch
    the schedule is a function of the step alone, which both runs evaluate in float32 (limit: 4
    float32 ulps, relative). A learning rate scaled by the world size fails here at once, where
    the trajectory would show it only as a drift among the noise."""
    a, b = run.result().get("learning_rates") or [], ref.result().get("learning_rates") or []
    b = b[: len(a)]
    limit = LR_ULPS * 2.0**-24
    if not a or len(a) != len(b):
        return Check("lr_schedule", run.name, False, None, limit, f"{len(a)} vs {len(b)} learning rates recorded")
    rel = [abs(x - y) / abs(y) if y else abs(x) for x, y in zip(a, b, strict=True)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    where = f"worst at step {worst + 1} ({a[worst]:.6g} vs {b[worst]:.6g})"
    detail = f"vs {ref.name}: {len(a)} steps; " + ("identical at every step" if rel[worst] == 0 else where)
    return Check("lr_schedule", run.name, rel[worst] <= limit, rel[worst], limit, detail,
                 derivation=f"relative, {LR_ULPS} float32 ulps: the same schedule evaluated at the same step")


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
    """Ranks' local tokens add up to the global count, which equals the reference's over the
    same steps. Tokens a resumed run restored at another world size belong to no current rank."""
    results = [o.result or {} for o in run.ranks]
    local = sum(int(r.get("tokens_local", 0)) for r in results) + int(results[0].get("tokens_local_unattributed", 0))
    glob = {int(r.get("tokens_global", -1)) for r in results}
    ok = len(glob) == 1 and local == next(iter(glob))
    detail = f"sum of rank tokens {local}, global {sorted(glob)}"
    if ref is not None and ref is not run:
        steps, per_step = results[0].get("steps"), ref.result().get("tokens_global_per_step") or []
        early = steps is not None and steps < len(per_step)  # a run stopped early: the reference's first steps
        ref_tokens = sum(per_step[:steps]) if early else int(ref.result().get("tokens_global", -1))
        ok = ok and ref_tokens in glob
        detail += f", {ref.name} {ref_tokens}"
    return Check("token_accounting", run.name, ok, local, next(iter(glob)) if len(glob) == 1 else None, detail)


def _peaks(run: RunOutcome, key: str) -> list[int]:
    return [int((o.result or {}).get(key, 0)) for o in run.ranks]


def memory_ceilings(run: RunOutcome, s: Scenario) -> list[Check]:
    """Peak MLX memory and peak RSS per rank (the largest rank) and summed over ranks. RSS counts
    from what the rank held before its job (``rss_runtime_bytes``: MLX's device runtime and the
    trainer's libraries, ``harness.rank.entry``; about 0.1 GB on a CPU, 0.6 to 1.2 GB on a CUDA
    GPU), so one ceiling holds on every device."""
    c = s.checks
    out = []
    runtime = _peaks(run, "rss_runtime_bytes")
    for label, key, per_rank, total in (
        ("rss", "rss_peak_bytes", c.max_rss_mb, c.max_total_rss_mb),
        ("mlx", "mlx_peak_bytes", c.max_mlx_mb, c.max_total_mlx_mb),
    ):
        peaks = _peaks(run, key)
        if label == "rss":
            peaks = [p - r for p, r in zip(peaks, runtime, strict=True)]
        mbs = ", ".join(f"{p / MB:.1f}" for p in peaks)
        if label == "rss" and any(runtime):
            mbs += f" above the runtime's {', '.join(f'{r / MB:.0f}' for r in runtime)}"
        if per_rank is not None:
            v = max(peaks) / MB
            out.append(Check(f"memory_{label}_per_rank_mb", run.name, v <= per_rank, round(v, 2), per_rank,
                             f"per rank: {mbs}"))
        if total is not None:
            v = sum(peaks) / MB
            out.append(Check(f"memory_{label}_total_mb", run.name, v <= total, round(v, 2), total,
                             f"sum of {run.world_size} ranks"))
    return out


AGREED_FIELDS = ("steps", "losses", "stop", "evals", "compile", "tokens_global")


def ranks_agree(run: RunOutcome) -> Check:
    """Every rank reports the same steps, losses, stop, eval metrics (bitwise) and compile state;
    figures a trainer reports on rank 0 only (sent to the others after training) are not compared."""
    results = [o.result or {} for o in run.ranks]
    sent = (results[0].get("from_rank0") or {}) if results else {}
    fields = [k for k in AGREED_FIELDS if k not in sent.get("fields", ())]
    differ = []
    for key in fields:
        values = [r.get(key) for r in results]
        if key == "evals":  # per-rank figures (local tokens and rows) legitimately differ
            values = [[{k: e[k] for k in ("step", "loss", "tokens")} for e in v or []] for v in values]
        if any(v != values[0] for v in values[1:]):
            differ.append(key)
    detail = f"{run.world_size} ranks; " + (f"differ in {', '.join(differ)}" if differ else
                                            f"same {', '.join(fields)}")
    if sent and run.world_size > 1:
        detail += f"; {', '.join(sent['fields'])} are rank 0's ({sent['why']})"
    return Check("ranks_agree", run.name, not differ, len(differ), 0, detail)


def rank0_side_effects(run: RunOutcome) -> Check:
    """Callbacks, log lines and saves happened on rank 0 only (and did happen there). An external
    trainer reports its own saves only (the callbacks are the harness's)."""
    counts = [(o.result or {}).get("side_effects", {}) for o in run.ranks]
    others = sum(sum(c.values()) for c in counts[1:])
    main = counts[0]
    ok = others == 0 and main.get("saves", 0) >= 1 and ("callbacks" not in main or main["callbacks"] > 0)
    detail = f"rank 0: {main}; other ranks: {others} side effects"
    return Check("rank0_side_effects", run.name, ok, others, 0, detail)


def global_rng_untouched(run: RunOutcome) -> Check:
    """No rank changed numpy's or MLX's global RNG state (all randomness is local and seeded)."""
    touched = [o.rank for o in run.ranks if (o.result or {}).get("global_rng_untouched") is not True]
    return Check("global_rng_untouched", run.name, not touched, len(touched), 0,
                 f"ranks that changed it: {touched}" if touched else "numpy and MLX global RNG unchanged on every rank")


def data_share(run: RunOutcome, ref: RunOutcome, slack: float, micro_rows: int | None = None) -> Check:
    """Each rank holds about its share of the data bytes one process holds (seed 003's criterion).

    The share is 1/N, or ceil(m/N)/m when the m rows of a micro-batch do not divide by N.
    """
    held = [int((o.result or {}).get("data", {}).get("bytes_held", -1)) for o in run.ranks]
    whole = int(ref.result().get("data", {}).get("bytes_held", 0))
    m = micro_rows or run.world_size
    limit = whole * (1 + slack) * -(-m // run.world_size) / m
    worst = max(held)
    return Check("data_share_bytes", run.name, 0 <= worst <= limit, worst, round(limit),
                 f"per rank: {', '.join(map(str, held))}; {ref.name} holds {whole}")


def expected_failure(run: RunOutcome, expect: str, every_rank: bool = False) -> Check:
    """A run that must fail: it did, with ``expect`` in its message (``every_rank``: in every
    rank's own error), and left no process behind."""
    if run.ok:
        return Check("expected_failure", run.name, False, None, None, f"run passed; expected an error with {expect!r}")
    failure = run.failure or ""
    ok = expect in failure and not run.watch.survivors
    first = failure.splitlines()[0] if failure else ""
    detail = f"expected {expect!r}; got: {first}"
    if every_rank:
        hits = sum(expect in str((o.result or {}).get("error", "")) for o in run.ranks)
        ok = ok and hits == run.world_size
        detail += f"; on {hits} of {run.world_size} ranks"
    return Check("expected_failure", run.name, ok, None, None, detail)


def expectations(run: RunOutcome, spec: RunSpec) -> list[Check]:
    """What the scenario says every rank of this run must report (compile scope, stop step)."""
    out = []
    results = [o.result or {} for o in run.ranks]
    if spec.expect_compile_scope is not None:
        scopes = [r.get("compile", {}).get("scope") for r in results]
        reasons = {r.get("compile", {}).get("fallback_reason") for r in results}
        ok = all(sc == spec.expect_compile_scope for sc in scopes) and len(reasons) == 1
        detail = f"per rank: {', '.join(map(str, scopes))}; fallback reason: {sorted(map(str, reasons))[0]}"
        out.append(Check("compile_scope", run.name, ok, scopes[0], spec.expect_compile_scope, detail))
    if spec.expect_stop_step is not None:
        stops = [(r.get("stop") or {}).get("step") for r in results]
        ok = all(st == spec.expect_stop_step for st in stops)
        who = (results[0].get("stop") or {}).get("requested_by")
        out.append(Check("stop_step", run.name, ok, stops[0], spec.expect_stop_step,
                         f"per rank: {', '.join(map(str, stops))}; requested by ranks {who}"))
    return out
