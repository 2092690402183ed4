"""pytest-benchmark's own options on the harness's throughput benchmarks (tests/test_benchmarks.py),
run as a separate pytest without xdist, on a small scenario."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, write_scenario


def _pytest(*args: str, scenario: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLX_DDP_HARNESS_BENCH_SCENARIOS": str(scenario or "")}
    env.pop("PYTEST_XDIST_WORKER", None)  # this pytest is not an xdist worker
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=900)


@pytest.mark.ranks
@pytest.mark.full  # pytest-benchmark's own options (the plugin's saved benchmark: test_pytest_plugin.py)
def test_benchmark_json_save_and_compare_fail(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, "bench_small", (1, 2), steps=5)
    storage = tmp_path / "storage"
    common = ("tests/test_benchmarks.py", "-m", "throughput", "-q", f"--benchmark-storage=file://{storage}")
    first = _pytest(*common, f"--benchmark-json={tmp_path / 'bench.json'}", "--benchmark-save=base",
                    scenario=scenario)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    bench = json.loads((tmp_path / "bench.json").read_text())["benchmarks"]
    by_run = {b["extra_info"]["run"]: b for b in bench}
    assert set(by_run) == {"single", "ddp2"}
    for b in by_run.values():
        assert b["stats"]["rounds"] == 4 and b["stats"]["median"] > 0  # steps 2-5, seconds per step
        assert b["extra_info"]["scenario"] == "bench_small" and b["extra_info"]["median_tok_s"] > 0
    assert len(by_run["ddp2"]["extra_info"]["rss_peak_mb_per_rank"]) == 2

    # a saved run 4x faster than anything this machine does: comparing against it must fail
    saved = next(storage.glob("*/0001_base.json"))
    doc = json.loads(saved.read_text())
    for b in doc["benchmarks"]:
        for key in ("min", "max", "mean", "median", "q1", "q3", "ld15iqr", "hd15iqr"):
            b["stats"][key] /= 4
    saved.write_text(json.dumps(doc))
    second = _pytest(*common, "--benchmark-compare=0001", "--benchmark-compare-fail=median:50%", scenario=scenario)
    out = second.stdout + second.stderr
    assert second.returncode != 0 and "Performance has regressed" in out, out[-3000:]
    assert "test_scenario_throughput[bench_small-single]" in out and "median" in out


def test_benchmark_output_under_xdist_is_a_usage_error(tmp_path: Path) -> None:
    proc = _pytest("tests/test_benchmarks.py", "-n", "2", f"--benchmark-json={tmp_path / 'b.json'}", "--co", "-q")
    assert proc.returncode == 4  # pytest's usage error
    assert "--benchmark-json record nothing under xdist (-n)" in proc.stderr + proc.stdout
    assert not (tmp_path / "b.json").exists()
