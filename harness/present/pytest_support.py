"""What the pytest plugin needs that is not a pytest node: which files are scenarios, a failed
check as one line, and the closing block (scenarios and tests by outcome, rank-slot waits, where
the artifacts went)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from harness.present.conditions import QUEUE_NOTE_S

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
    lines = [f"{n} scenario{'s' if n != 1 else ''}: {n - failed - skipped} passed, {failed} failed, "
             f"{skipped} skipped; tests: {checks}"]
    queued = {r.nodeid.removesuffix("::launch"): float(dict(r.user_properties).get("queued_s") or 0)
              for key in ("passed", "failed") for r in stats.get(key, [])
              if str(r.nodeid).endswith("::launch") and getattr(r, "user_properties", None)}
    waits = {k: v for k, v in queued.items() if v >= QUEUE_NOTE_S}
    if waits:
        longest = max(waits, key=waits.__getitem__)
        lines.append(f"rank slots: {len(waits)} run{'s' if len(waits) != 1 else ''} waited {sum(waits.values()):.1f} s "
                     f"in all before starting (the longest: {longest}, {waits[longest]:.1f} s)")
    return [*lines, f"artifacts: {where}"]


def named_paths(config: Any) -> list[Path]:
    """The paths named on the command line (without ``::`` parts)."""
    root = Path(config.invocation_params.dir)
    return [(root / a.split("::")[0]).resolve() for a in config.invocation_params.args if not a.startswith("-")]


def scenario_toml(path: Path) -> dict[str, Any] | None:
    """The parsed TOML of a scenario file ({} when it is malformed but has a ``[scenario]``
    table, for collection to report), or None for any other TOML file (pyproject.toml)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return {} if "[scenario]" in text else None
    return data if isinstance(data.get("scenario"), dict) else None


def describe(c: Any) -> str:
    """A failed check as one line: name, run, value against limit, and the check's own detail."""
    figures = f": {c.value:.4g} > limit {c.limit:.4g}" if isinstance(c.value, int | float) and isinstance(
        c.limit, int | float) else ""
    return f"{c.name} ({c.run}){figures}; {c.detail}"
