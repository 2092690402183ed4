"""The verdicts of the two collective mutations that change when a rank arrives rather than what
the all-reduce returns (``harness.rank.collective_mutations``): a straggler must change nothing
but the others' wait, which is measured from their step times; a rank killed inside a collective
must be named as the run's failing rank, not left to a time limit."""

from __future__ import annotations

import statistics
from typing import Any

from harness.controller.outcome import RunOutcome
from harness.judge.checks import Check
from harness.scenario.checks import CheckName

WAIT_SEEN = 0.5  # of the planted delay: the others' extra step time that shows they waited


def _fault(run: RunOutcome, action: str) -> dict[str, Any] | None:
    return next((e for o in run.ranks for e in o.events
                 if e.get("kind") == "fault" and e.get("phase") == "collective" and e.get("action") == action), None)


def waited(events: list[dict[str, Any]], step: int) -> float | None:
    """How much longer than its usual step (the median of its steps after the first, less the
    two the delay can reach) a rank's step ``step`` or the next took; None without enough steps."""
    times = {int(e["step"]): float(e["step_time_s"]) for e in events
             if e.get("kind") == "step" and isinstance(e.get("step_time_s"), int | float)}
    usual = [t for k, t in times.items() if k > 1 and k not in (step, step + 1)]
    hit = [times[k] for k in (step, step + 1) if k in times]
    if not usual or not hit:
        return None
    return max(hit) - statistics.median(usual)


def straggler_passed(run: RunOutcome, mutation: str, checks: list[Check]) -> Check:
    """Passes when the delay acted, every other check of the run passed, and every other rank's
    step time shows the wait (at least ``WAIT_SEEN`` of the delay)."""
    name = CheckName.mutation_caught
    fault = _fault(run, "delay")
    if fault is None:
        return Check(name, run.name, False, None, None, f"{mutation}: the delay never acted (no gradient all-reduce "
                     f"of the trainer's own was seen at the step it waits for)")
    delay, slow, step = float(fault["seconds"]), int(fault["rank"]), int(fault["step"])
    failed = [c.name for c in checks if not c.passed and c.applicable]
    waits = {o.rank: waited(o.events, step) for o in run.ranks if o.rank != slow}
    seen = min((w for w in waits.values() if w is not None), default=None)
    where = f"rank {slow} delayed {delay:g} s at step {step} inside its gradient all-reduce ({fault.get('site')})"
    shown = ", ".join(f"rank {r} waited {w:.2f} s" if w is not None else f"rank {r}: too few steps to tell"
                      for r, w in sorted(waits.items()))
    derivation = f"every other check passes, and each other rank's step {step} (or {step + 1}) exceeds its median " \
                 f"step by >= {WAIT_SEEN:g} x the delay"
    if failed:
        return Check(name, run.name, False, seen, WAIT_SEEN * delay,
                     f"{mutation}: a rank arriving late must change nothing, but {', '.join(failed)} failed; "
                     f"{where}; {shown}", derivation=derivation)
    ok = seen is not None and all(w is not None and w >= WAIT_SEEN * delay for w in waits.values())
    verdict = f"passed its {len([c for c in checks if c.applicable])} other checks" if ok else \
        "the others' wait does not show in their step times"
    return Check(name, run.name, ok, seen, WAIT_SEEN * delay, f"{mutation} {verdict}: {where}; {shown}",
                 derivation=derivation)


def rank_failure_named(run: RunOutcome, mutation: str) -> Check:
    """Passes when the run failed with the killed rank named first, by its signal, before any time
    limit: the value is how long after the kill the harness knew."""
    name = CheckName.mutation_caught
    fault = _fault(run, "sigkill")
    if fault is None:
        return Check(name, run.name, False, None, None, f"{mutation}: the kill never acted (no gradient all-reduce "
                     f"of the trainer's own was seen at the step it waits for)"
                     + (f"; the run failed: {run.failure.splitlines()[0]}" if run.failure else ""))
    killed = int(fault["rank"])
    took = run.watch.named_at - float(fault["time"]) if run.watch.named_at else None
    first = (run.failure or "").splitlines()[0] if run.failure else ""
    named = f"rank {killed} ended with signal SIGKILL" in first and not first.startswith("watchdog")
    said = "the run completed" if run.ok else f"the run failed: {first}"
    how = "" if took is None else f" {took:.1f} s after the kill"
    return Check(name, run.name, named and not run.ok, took, None,
                 f"{mutation}: rank {killed} killed at step {fault['step']} inside its gradient all-reduce "
                 f"({fault.get('site')}); {'named' if named else 'NOT named'} as the failing rank{how}: {said}",
                 derivation=f"the run's failure names rank {killed} first, ended by SIGKILL, before any limit")
