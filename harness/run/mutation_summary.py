"""What each mutated run of a scenario proved, one record per run (``result.json``'s
``mutations``; the mutation table reads it): the mutation, what it must show (``expects``: caught
by a failing check, ``pass`` for a straggler, ``rank_failure`` for a rank killed), how it came
out, and the check that showed it with its value, limit and margin (value / limit)."""

from __future__ import annotations

from typing import Any

from harness.scenario.checks import CheckName
from harness.scenario.names import MUTATION_EXPECTS, MUTATIONS_DESCRIBED


def _one(run: str, mutation: str, mine: list[dict[str, Any]]) -> dict[str, Any]:
    summary = next((c for c in mine if c["name"] == CheckName.mutation_caught), {})
    expects = MUTATION_EXPECTS.get(mutation, "caught")
    passed = bool(summary.get("passed"))
    out = {"run": run, "mutation": mutation, "what": MUTATIONS_DESCRIBED[mutation], "expects": expects,
           "passed": passed, "detail": summary.get("detail", "not judged: the run did not complete")}
    if expects != "caught":  # the mutation check itself is the figure: the wait, or the time to name the rank
        outcome = {"pass": ("passed", "FAILED"), "rank_failure": ("rank named", "NOT NAMED")}[expects]
        return {**out, "outcome": outcome[0 if passed else 1], "by": str(CheckName.mutation_caught),
                "value": summary.get("value"), "limit": summary.get("limit"), "margin": None, "also": []}
    required = summary.get("limit") or 0
    caught = [c for c in mine if c.get("result") == "caught"]
    finite = sorted((c for c in caught if c.get("margin") is not None), key=lambda c: c["margin"], reverse=True)
    exact = [c for c in caught if c.get("margin") is None]
    best = finite[0] if finite and finite[0]["margin"] >= required else (exact or finite or [None])[0]
    return {**out, "outcome": "caught" if passed else "NOT CAUGHT", "by": best["name"] if best else None,
            "value": best["value"] if best else None, "limit": best["limit"] if best else None,
            "margin": best.get("margin") if best else None, "exact": bool(best) and best.get("margin") is None,
            "also": [{"check": c["name"], "margin": c.get("margin")} for c in caught if c is not best]}


def mutation_summary(runs: list[tuple[str, str | None]], checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per mutated run (``runs``: each run's name and mutation, in order) from the
    scenario's checks as ``result.json`` holds them."""
    return [_one(name, m, [c for c in checks if c["run"] == name]) for name, m in runs if m]
