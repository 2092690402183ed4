"""Throughput of the main scenarios, recorded through pytest-benchmark's fixture.

Each run of a main scenario is one benchmark whose rounds are its post-step-1 optimizer steps
(seconds per step, as the ranks timed them), with tok/s and the step's token count in
``extra_info``; so ``--benchmark-json``, ``--benchmark-save``, ``--benchmark-compare`` and
``--benchmark-compare-fail`` work on the harness's own figures:

    pytest -m throughput --benchmark-json bench.json

pytest-benchmark disables itself under xdist (``-n``), where timings would be unreliable: these
tests then skip, saying so, and asking for benchmark output together with ``-n`` is a usage
error (see ``conftest.py``). ``MLX_DDP_HARNESS_BENCH_SCENARIOS`` (comma-separated scenario files)
replaces the main scenarios.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from harness.present.pytest_plugin import record_steps
from harness.scenario import load_scenario
from tests.conftest import REPO, cli

MAIN = ("text_parity", "vlm_parity", "guide_throughput")


def _scenario_files() -> list[Path]:
    chosen = os.environ.get("MLX_DDP_HARNESS_BENCH_SCENARIOS")
    if chosen:
        return [Path(p) for p in chosen.split(",") if p]
    return [REPO / "scenarios" / f"{name}.toml" for name in MAIN]


CASES = [pytest.param(f, r.name, id=f"{s.name}-{r.name}")
         for f in _scenario_files() for s in [load_scenario(f)] for r in s.runs if r.expect_error is None]
_RESULTS: dict[Path, dict[str, Any]] = {}  # one run of each scenario per test process


def scenario_result(path: Path, out: Path) -> dict[str, Any]:
    if path not in _RESULTS:
        proc = cli("run", str(path), "--out", str(out))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        _RESULTS[path] = json.loads((out / "result.json").read_text())["scenarios"][0]
    return _RESULTS[path]


@pytest.mark.throughput
@pytest.mark.ranks
@pytest.mark.parametrize(("path", "run"), CASES)
def test_scenario_throughput(benchmark: Any, path: Path, run: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("pytest-benchmark disables itself under xdist (-n); run: pytest -m throughput")
    scenario = scenario_result(path, tmp_path_factory.mktemp(path.stem))
    r = next(x for x in scenario["runs"] if x["name"] == run)
    assert scenario["passed"] and r["ok"], scenario["checks"]
    tokens, tok_s = r["tokens_global_per_step"][1:], r["tok_s_global"][1:]  # after step 1, as the tables
    assert len(tokens) == len(tok_s) == r["steps"] - 1 >= 2
    seconds = [t / v for t, v in zip(tokens, tok_s, strict=True)]
    assert all(s > 0 for s in seconds)
    record_steps(benchmark, seconds, {
        "scenario": scenario["name"], "run": run, "world_size": r["world_size"],
        "median_tok_s": r["median_tok_s"], "tokens_per_step": sorted(tokens)[len(tokens) // 2],
        "mlx_peak_mb_per_rank": [round(b / 2**20, 1) for b in r["mlx_peak_bytes"]],
        "rss_peak_mb_per_rank": [round(b / 2**20, 1) for b in r["rss_peak_bytes"]],
    })
    assert benchmark.disabled or benchmark.stats.stats.rounds == len(seconds)
