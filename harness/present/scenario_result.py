"""A scenario run from Python: ``run_scenario_file`` launches every run as the CLI does, judges
them, writes the artifacts, and returns a ``ScenarioResult`` a test can assert on."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.scenario import Scenario, ScenarioError, load_scenario, parse_scenario


def rss_above_baseline(r: dict[str, Any]) -> int | None:
    """A rank result's peak RSS above its baseline, or None where it reported no baseline."""
    peak, base = r.get("rss_peak_after_baseline_bytes"), r.get("rss_baseline_bytes")
    return None if peak is None or base is None else int(peak) - int(base)


@dataclass
class RunResult:
    """One run: whether it completed, why not, and what rank 0 reported."""

    name: str
    world_size: int
    ok: bool
    failure: str | None
    floor: str | None  # a noise-floor run the harness added: what it computes
    result: dict[str, Any]  # rank 0's result.json
    ranks: list[dict[str, Any]]  # every rank's result.json

    @property
    def losses(self) -> list[float]:
        return list(self.result.get("losses") or [])

    @property
    def tok_s(self) -> list[float]:
        return list(self.result.get("tok_s_global") or [])

    @property
    def rss_peak_bytes(self) -> list[int | None]:
        """Each rank's peak RSS above its baseline (``harness.memory.sampler``), as the ceilings count
        it; None for a rank that reported none (it failed, or ended before its baseline)."""
        return [rss_above_baseline(r) for r in self.ranks]

    @property
    def mlx_peak_bytes(self) -> list[int]:
        return [int(r.get("mlx_peak_bytes", 0)) for r in self.ranks]


@dataclass
class ScenarioResult:
    """A judged scenario: its runs (floor runs included), its checks, and where its artifacts are."""

    name: str
    status: str  # "passed", "inconclusive" (no check failed, one could not decide), "failed" or "error" (a run
    # crashed or hung)
    runs: dict[str, RunResult]
    checks: list[Any]  # harness.judge.checks.Check
    table: str
    artifacts: Path
    summary: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def checks_of(self, run: str) -> list[Any]:
        return [c for c in self.checks if c.run == run]

    def check(self, name: str, run: str) -> Any:
        """The check ``name`` of run ``run``; KeyError naming what was judged if there is none."""
        for c in self.checks_of(run):
            if c.name == name:
                return c
        raise KeyError(f"no check {name!r} for run {run!r}; judged: {[c.name for c in self.checks_of(run)]}")


def scenario_from(scenario: Path | str | dict[str, Any], workdir: Path) -> Scenario:
    """A scenario from a file path, TOML text (relative paths in it resolve against ``workdir``)
    or a dict of the file's tables."""
    if isinstance(scenario, dict):
        return parse_scenario(scenario, "<scenario dict>", workdir)
    if isinstance(scenario, Path) or "\n" not in scenario and scenario.endswith(".toml"):
        return load_scenario(scenario)
    try:
        data = tomllib.loads(scenario)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"<scenario text>: malformed TOML ({e})") from e
    return parse_scenario(data, "<scenario text>", workdir)


def run_scenario_file(s: Scenario, artifacts_root: Path, backend: str | None = None,
                      progress: Any = None) -> ScenarioResult:
    """Check the scenario's inputs as the CLI does, run it, judge it and write its artifacts
    (``result.json``, ``report.md``, plots and rank logs) to ``artifacts_root/<scenario name>``;
    ``progress`` (a ``harness.controller.progress.Observer``) is shown each run as it goes."""
    from harness.present.report import write_report
    from harness.present.tables import scenario_text
    from harness.run.pipeline import run_scenario

    out = artifacts_root / s.name
    (outcomes, checks, summary), doc = run_scenario(s, out, backend, progress)
    write_report(out, doc)
    runs = {}
    for o in outcomes:
        ranks = [r.result or {} for r in o.ranks]
        runs[o.name] = RunResult(o.name, o.world_size, o.ok, o.failure, o.floor, ranks[0] if ranks else {}, ranks)
    return ScenarioResult(s.name, summary["status"], runs, checks, scenario_text(summary, "plain"), out, summary)
