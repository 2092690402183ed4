"""Expected failures judged as behaviours with power; the precision policy of parity runs; a
user script without a step-local probe (``harness.api`` ``run.probe``)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from harness.judge.behaviours import mark_expected_failures, reason_for
from harness.judge.checks import Check
from harness.rank.entry import set_precision
from harness.scenario import ScenarioError, load_scenario
from harness.scenario.plan import job_for
from tests.conftest import EXAMPLE, cli, script_scenario, write_scenario

BEHAVIOUR = {"batch_split": {"reason": "depends on the split", "checks": {"step_loss_parity": 1e-4,
                                                                          "step_grad_parity": 0.07}}}


def _pair(loss: tuple[float, float], grad: tuple[float, float]) -> list[Check]:
    return [Check("step_loss_parity", "ddp2", loss[0] <= loss[1], loss[0], loss[1]),
            Check("step_grad_parity", "ddp2", grad[0] <= grad[1], grad[0], grad[1])]


def test_a_behaviour_is_shown_by_any_of_its_checks() -> None:
    checks = _pair((1e-4, 3.9e-3), (0.077, 3.9e-3))  # the loss check lacks power, the gradient sees it
    mark_expected_failures(checks, BEHAVIOUR)
    assert [c.result for c in checks] == ["xfail", "xfail"] and all(c.passed for c in checks)
    assert "shown by step_grad_parity" in checks[0].detail


def test_a_behaviour_is_gone_only_where_a_passing_check_had_power() -> None:
    gone = _pair((1e-6, 3.9e-6), (1e-6, 3.9e-6))
    mark_expected_failures(gone, BEHAVIOUR)
    assert [c.result for c in gone] == ["XPASS", "XPASS"] and not any(c.passed for c in gone)
    blind = _pair((1e-4, 3.9e-3), (1e-3, 0.1))  # both limits above what the marker recorded
    mark_expected_failures(blind, BEHAVIOUR)
    assert [c.result for c in blind] == ["inconclusive", "inconclusive"] and all(c.passed for c in blind)
    assert "step_grad_parity limit 0.1 vs recorded 0.07" in blind[1].detail


def test_a_check_without_power_is_never_an_expected_failure_shown() -> None:
    """A trajectory check failed as "no power" (its limit as large as training itself) is no
    evidence of the behaviour: it stays a failure, while one that failed on its value is the
    behaviour shown."""
    behaviour = {"mean_of_means": {"reason": "a mean of per-rank means", "checks": {"loss_parity": 1e-2,
                                                                                   "param_parity": 0.15}}}
    blind = [Check("loss_parity", "ddp2", False, 0.3, 1.8, "no power: ...", no_power=True),
             Check("param_parity", "ddp2", False, 0.9, 8.7, "no power: ...", no_power=True)]
    mark_expected_failures(blind, behaviour)
    assert [c.result for c in blind] == ["FAIL", "FAIL"] and not any(c.passed for c in blind)
    seen = [Check("loss_parity", "ddp2", False, 3e-2, 1e-4), Check("param_parity", "ddp2", True, 1e-6, 1e-5)]
    mark_expected_failures(seen, behaviour)
    assert [c.result for c in seen] == ["xfail", "xfail"] and all(c.passed for c in seen)


def test_a_check_that_measured_nothing_shows_nothing() -> None:
    """A step check that failed for want of probes (no value) neither shows the behaviour nor
    counts as xfail: it stays a failure; a second behaviour on the same check does not re-judge it."""
    checks = [Check("step_loss_parity", "ddp2", False, None, None, "single recorded no probes"),
              Check("step_grad_parity", "ddp2", False, 0.077, 3.9e-3)]
    mark_expected_failures(checks, {**BEHAVIOUR, "again": {"reason": "twice", "checks": {"step_grad_parity": 0.07}}})
    assert checks[0].result == "FAIL" and not checks[0].passed
    assert checks[1].result == "xfail" and checks[1].xfail == "depends on the split"


def test_short_form_markers_and_runs() -> None:
    expected = {"loss_parity": "why", "token_accounting": {"ddp2": "only here"}}
    assert reason_for(expected, "loss_parity", "ddp4") == "why"
    assert reason_for(expected, "token_accounting", "ddp2") == "only here"
    assert reason_for(expected, "token_accounting", "ddp4") is None
    checks = [Check("loss_parity", "ddp2", True, 1e-6, 1e-5)]
    mark_expected_failures(checks, expected)
    assert checks[0].result == "XPASS"


def test_behaviour_tables_are_validated(tmp_path: Path) -> None:
    for body, key in (('checks = { loss_parityy = 1e-3 }\nreason = "x"', "checks.loss_parityy"),
                      ('checks = { loss_parity = -1 }\nreason = "x"', "checks.loss_parity"),
                      ('checks = { loss_parity = 1e-3 }', "reason"),
                      ('checks = { loss_parity = 1e-3 }\nreason = "x"\nruns = ["ddp9"]', "runs")):
        path = write_scenario(tmp_path, "bad", steps=2, extra=f"\n[checks.expected_failures.b]\n{body}\n")
        with pytest.raises(ScenarioError, match=rf"\[checks\]\.expected_failures\.b\.{key}"):
            load_scenario(path)


def test_parity_runs_compute_at_full_float32_unless_asked(tmp_path: Path) -> None:
    s = load_scenario(write_scenario(tmp_path, "p", steps=2))
    assert s.for_run(s.run("ddp2")).train.precision == "full"
    asked = dataclasses.replace(s, train=dataclasses.replace(s.train, precision="device"))
    assert asked.for_run(asked.run("ddp2")).train.precision == "device"
    throughput = load_scenario(REPO_SCENARIOS / "guide_throughput.toml")
    assert throughput.for_run(throughput.runs[0]).train.precision == "device"
    saved = os.environ.pop("MLX_ENABLE_TF32", None)
    try:
        job = job_for(throughput, throughput.runs[0].name)
        set_precision(dataclasses.replace(job, scenario=throughput.for_run(throughput.runs[0])))
        assert "MLX_ENABLE_TF32" not in os.environ
        full = dataclasses.replace(throughput.train, precision="full")
        set_precision(dataclasses.replace(job, scenario=dataclasses.replace(job.scenario, train=full)))
        assert os.environ["MLX_ENABLE_TF32"] == "0"
    finally:
        os.environ.pop("MLX_ENABLE_TF32", None)
        if saved is not None:
            os.environ["MLX_ENABLE_TF32"] = saved


REPO_SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


def _result(out: Path) -> dict:
    (s,) = json.loads((out / "result.json").read_text())["scenarios"]
    return s


@pytest.mark.ranks
def test_a_behaviour_without_power_is_inconclusive_and_one_with_power_is_xpass(tmp_path: Path) -> None:
    marker = '\n[checks.expected_failures.drift]\nreason = "{why}"\nchecks = {{ loss_parity = {delta} }}\n'
    blind = write_scenario(tmp_path, "blind", steps=3, extra=marker.format(why="smaller than rounding", delta=1e-15))
    p = cli("run", str(blind), "--out", str(tmp_path / "blind"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    s = _result(tmp_path / "blind")
    c = next(c for c in s["checks"] if c["name"] == "loss_parity")
    assert c["result"] == "inconclusive" and c["passed"] and c["power"] == c["limit"] > 1e-15, c
    assert c["precision"] == "float32" and s["inconclusive"] == ["loss_parity (ddp2)"]
    assert "blind: PASSED (inconclusive" in p.stdout
    seen = write_scenario(tmp_path, "seen", steps=3, extra=marker.format(why="large", delta=1.0))
    p = cli("run", str(seen), "--out", str(tmp_path / "seen"))
    assert p.returncode == 1, p.stdout[-3000:]
    c = next(c for c in _result(tmp_path / "seen")["checks"] if c["name"] == "loss_parity")
    assert c["result"] == "XPASS" and "would have seen the recorded 1" in c["detail"], c


@pytest.mark.ranks
def test_a_script_that_hands_over_no_probe_has_its_step_checks_na(scenario_dir: Path) -> None:
    """(A script whose probe catches a defect: tests/test_trainers.py, the example with its bugs.)"""
    source = EXAMPLE.read_text()
    call = "        run.probe(step, model, global_loss_and_grad, inputs, targets, mask)\n"
    assert call in source
    blind = script_scenario(scenario_dir, source.replace(call, ""), name="noprobe")
    p = cli("run", str(blind), "--out", str(scenario_dir / "out"))
    assert p.returncode == 0, p.stdout[-3000:]
    c = next(c for c in _result(scenario_dir / "out")["checks"] if c["name"] == "step_grad_parity")
    assert c["result"] == "n/a" and "run.probe(step, model, fn, batch)" in c["detail"], c
