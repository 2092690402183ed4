"""``gate --env PYTHON``: the same scenarios under two Python environments, in turns, judged as
``gate --against`` judges two revisions. Real ranks both ways: an environment whose trainer
package is slowed fails the gate, an identical one never shows a regression."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.exit_codes import EXIT_INCONCLUSIVE, EXIT_PASS
from tests.conftest import REPO


def _python(path: Path, body: str) -> Path:
    """An interpreter of its own environment: a wrapper that runs this Python with ``body``'s settings."""
    path.write_text(f"#!/bin/sh\n{body} exec {sys.executable} \"$@\"\n")
    path.chmod(0o755)
    return path


def _gate(python: Path, other: Path, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    """The gate of ``speed_gate`` cut from 40 steps to 8 (its speed is its fastest tenth of steps: here the fastest)."""
    scenario = tmp_path / "speed_gate.toml"
    if not scenario.exists():
        text = (REPO / "scenarios" / "speed_gate.toml").read_text()
        assert "steps = 40\n" in text
        scenario.write_text(text.replace("steps = 40\n", "steps = 8\n"))
    return subprocess.run([str(python), "-m", "harness", "gate", "--env", str(other), str(scenario),
                           "--min-pairs", "3", "--pairs", "6", "--out", str(tmp_path / "gate"), *flags],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)


@pytest.mark.ranks
@pytest.mark.mlx_ddp_world_size(2)
def test_an_environment_with_a_slowed_trainer_fails_the_gate(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gate_power", REPO / "benchmarks" / "gate_power.py")
    gate_power = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gate_power)
    slow_root = tmp_path / "slow"
    shutil.copytree(REPO / "harness", slow_root / "harness")
    # the reference trainer, as this environment installs it: about a quarter of the tok/s. Its pairs run
    # beside other tests' ranks, which make them noisy: a neighbour's ranks once left a pair unable to
    # tell a 50 % slowdown from none (the gate's power on a quiet machine: benchmarks/gate_power.py)
    gate_power.slowed(slow_root, 0.75)
    slow = _python(tmp_path / "slow-python", f'PYTHONPATH="{slow_root}"')
    same = _python(tmp_path / "same-python", "")

    p = _gate(slow, same, tmp_path)  # the candidate (this environment) is the slowed one
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    record = json.loads((tmp_path / "gate" / "gate.json").read_text())
    speed = [g for g in record["gates"] if g["metric"] == "throughput (paired)"]
    assert {g["run"] for g in speed} == {"single", "ddp2"} and all(g["result"] == "FAIL" for g in speed), speed
    assert all(g["result"] == "pass" for g in record["gates"] if g["metric"] == "loss")  # same losses, slower
    assert f"environments: baseline {same}" in p.stdout and "mlx: " in p.stdout and "numpy: " in p.stdout


@pytest.mark.ranks
@pytest.mark.mlx_ddp_world_size(2)  # beside other tests' ranks: a verdict it accepts is never a regression
@pytest.mark.full  # identical code never failing a gate: test_paired_gate.py, in every session
def test_an_identical_environment_passes_the_gate(tmp_path: Path) -> None:
    # Beside other tests on two cores a pair's speeds vary far more than in a gate run alone (the
    # gate's rates are measured alone: benchmarks/gate_power.py), so this one asks a coarser
    # question: not a 20 % slowdown, against one of 50 % or more.
    same = _python(tmp_path / "same-python", "")
    p = _gate(same, _python(tmp_path / "twin-python", ""), tmp_path, "--slowdown-margin", "20", "--detect", "50")
    assert p.returncode in (EXIT_PASS, EXIT_INCONCLUSIVE), p.stdout[-3000:] + p.stderr[-2000:]  # never a regression
    assert "their Python and packages are the same versions" in p.stdout


@pytest.mark.parametrize(("args", "needle"), [
    (["--env", "no-such-python-x"], "--env no-such-python-x: not a Python interpreter here"),
    (["--env", "tox:nope"], "--env tox:nope: no .tox/nope/bin/python (create it first: tox -e nope --notest)"),
    (["--env", sys.executable, "--against", "HEAD"], "give --against REV or --env PYTHON, not both"),
])
def test_gate_env_refuses_bad_input_with_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    p = subprocess.run([sys.executable, "-m", "harness", "gate", str(REPO / "scenarios" / "speed_gate.toml"), *args],
                       cwd=tmp_path, capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and needle in p.stderr, p.stderr
