"""What the pytest plugin needs that is not a pytest node: which files are scenarios, a failed
check as one line, the closing block (scenarios and tests by outcome, rank-slot waits, where
the artifacts went), and pytest-benchmark's fixture for the ranks' step times."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

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


def benchmark_fixture(item: pytest.Item) -> Any:
    """pytest-benchmark's fixture for a test that is not a function (it makes it per test from
    the session's options, as its own ``benchmark`` fixture does); skips when it is off."""
    bs = getattr(item.config, "_benchmarksession", None)
    if bs is None:
        pytest.skip("--mlx-ddp-benchmark needs pytest-benchmark installed")
    if bs.skip or bs.disabled:
        pytest.skip("pytest-benchmark is off here (--benchmark-skip/--benchmark-disable, or under xdist -n)")
    from pytest_benchmark.fixture import BenchmarkFixture

    return BenchmarkFixture(item, add_stats=bs.benchmarks.append, logger=bs.logger, warner=item.warn,
                            disabled=bs.disabled, **bs.options)


def record_steps(benchmark: Any, seconds: list[float], extra: dict[str, Any]) -> None:
    """Give pytest-benchmark durations the ranks measured. It has no public call for durations
    measured elsewhere: ``_make_stats`` is what its own ``pedantic`` uses, and ``_mode`` marks the
    fixture used as ``pedantic`` does (pytest-benchmark is pinned below 6 for these two names)."""
    benchmark._mode = "durations measured by the ranks"
    if benchmark.disabled:  # --benchmark-disable: the run was still checked
        return
    benchmark.extra_info.update(extra)
    stats = benchmark._make_stats(1)
    for s in seconds:
        stats.update(s)
