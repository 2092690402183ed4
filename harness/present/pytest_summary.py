"""The pytest plugin's closing block: scenarios and checks by outcome, and where the artifacts went."""

from __future__ import annotations

from typing import Any

OUTCOMES = (("passed", "passed"), ("xfailed", "expected failures shown"), ("skipped", "skipped"),
            ("failed", "FAILED"))


def summary_lines(stats: dict[str, list[Any]], out: str | None) -> list[str]:
    """From pytest's terminal stats: one line of scenarios and tests by outcome (a scenario failed
    when any of its tests failed, was skipped when all were), one of where the artifacts are. Empty
    when no scenario was collected."""
    by_scenario: dict[str, set[str]] = {}
    counts = {k: 0 for k, _ in OUTCOMES} | {"error": 0}
    for key in counts:
        for report in stats.get(key, []):
            file = str(getattr(report, "nodeid", "")).split("::")[0]
            if not file.endswith(".toml") or (key == "passed" and report.when != "call"):
                continue
            counts[key] += 1
            by_scenario.setdefault(file, set()).add(key)
    if not by_scenario:
        return []
    n = len(by_scenario)
    failed = sum(bool(seen & {"failed", "error"}) for seen in by_scenario.values())
    skipped = sum(seen == {"skipped"} for seen in by_scenario.values())
    checks = ", ".join(f"{counts[k]} {label}" for k, label in OUTCOMES)
    if counts["error"]:
        checks += f", {counts['error']} errors"
    where = out if out else "pytest's temporary directory (--mlx-ddp-out DIR keeps them)"
    return [f"{n} scenario{'s' if n != 1 else ''}: {n - failed - skipped} passed, {failed} failed, "
            f"{skipped} skipped; tests: {checks}",
            f"artifacts: {where}"]
