"""Parity verdicts on doctored figures: step-local limits from rounding, trajectories against a
measured floor, refused floors, bitwise reruns, absolute overrides, and the mutation verdict."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.controller.outcome import RankOutcome, RunOutcome, WatchReport
from harness.judge.checks import Check
from harness.judge.families import mutation_caught
from harness.judge.parity import U_ACC, Floor, eval_parity, loss_parity, param_parity, rounding, step_local
from harness.judge.verdict import judge
from harness.scenario import CheckSpec, RunSpec, Scenario
from harness.scenario.plan import ScenarioPlan, plan_scenario
from tests.conftest import train_result

U32 = 2.0**-24


def _scenario(**checks: object) -> ScenarioPlan:
    return plan_scenario(Scenario(name="p", runs=[RunSpec("single", 1), RunSpec("ddp2", 2)],
                                  checks=CheckSpec(reference="single", **checks)))


def _run(name: str, ws: int, losses: list[float], params: float = 0.0, evals: float | None = None,
         probes: list[dict] | None = None, u_in: float = U32, tokens: int = 1000, floor: str | None = None,
         recorded: list[int] = (1, 5), accelerator: str = "cpu") -> RunOutcome:
    """A run's figures; the reference ("single") carries the probe steps it recorded."""
    if name == "single":
        probes = [{"step": k, "loss": 3.0, "tokens": tokens} for k in recorded]
    result = train_result(losses=losses, tokens_global_per_step=[tokens] * len(losses), steps=5, steps_start=1,
                          precision={"u_in": u_in}, probes=probes or [], accelerator=accelerator,
                          evals=[] if evals is None else [{"step": len(losses), "loss": evals, "tokens": 500}])
    ranks = [RankOutcome(r, 0, False, dict(result), [], "") for r in range(ws)]
    return RunOutcome(name, ws, "ring", True, None, ranks, WatchReport(1.0, 0),
                      params={"w": np.full((4,), 1.0 + params, dtype=np.float64)}, floor=floor)


def _probe(step: int, loss: float, loss_ref: float, grad_rel: float, tokens: int = 1000,
           tokens_ref: int = 1000) -> dict:
    return {"step": step, "loss": loss, "loss_ref": loss_ref, "tokens": tokens, "tokens_ref": tokens_ref,
            "grad_rel": grad_rel, "worst_tensor": "w", "worst_rel": grad_rel, "ref_world_size": 1}


def test_step_local_limit_is_the_rounding_formula() -> None:
    s = _scenario()
    ref = _run("single", 1, [3.0])
    run = _run("ddp2", 2, [3.0], probes=[_probe(1, 3.0, 3.0, 1e-7), _probe(5, 3.0, 3.0, 1e-7)])
    model = rounding(s, run, ref)
    # 4 x (2^-24 x ceil(log2 1000) + u x (grad_accum 1 + ceil(log2 2)))
    assert model.relative(1000) == pytest.approx(4 * (U_ACC * 10 + U32 * 2))
    checks = {c.name: c for c in step_local(run, ref, s)}
    assert all(c.passed for c in checks.values())
    assert checks["step_grad_parity"].limit == pytest.approx(4 * (U_ACC * 10 + U32 * 2))
    assert "ceil(log2 1000)" in checks["step_grad_parity"].derivation


def test_step_local_fails_on_a_gradient_token_or_loss_error() -> None:
    s = _scenario()
    ref = _run("single", 1, [3.0])
    bad = _run("ddp2", 2, [3.0], probes=[_probe(1, 3.0, 3.0, 1e-7), _probe(5, 3.1, 3.0, 0.02, tokens=990)])
    checks = {c.name: c for c in step_local(bad, ref, s)}
    assert not checks["step_grad_parity"].passed and checks["step_grad_parity"].value == 0.02
    assert "worst at step 5" in checks["step_grad_parity"].detail
    assert not checks["step_token_parity"].passed and checks["step_token_parity"].value == 10
    assert not checks["step_loss_parity"].passed


def test_step_local_limit_follows_the_measured_matmul_precision() -> None:
    """A device whose float32 matmul rounds at TF32 (2^-11) gets a limit from that rounding."""
    s = _scenario()
    ref = _run("single", 1, [3.0], u_in=2.0**-11)
    run = _run("ddp2", 2, [3.0], probes=[_probe(1, 3.0, 3.0, 1e-4), _probe(5, 3.0, 3.0, 1e-4)], u_in=2.0**-11)
    grad = next(c for c in step_local(run, ref, s) if c.name == "step_grad_parity")
    assert grad.passed and grad.limit == pytest.approx(4 * (U_ACC * 10 + 2.0**-11 * 2))


def test_missing_probes_fail_and_unprobed_steps_are_not_applicable() -> None:
    s = _scenario()
    missing = step_local(_run("ddp2", 2, [3.0]), _run("single", 1, [3.0]), s)
    none_recorded = step_local(_run("ddp2", 2, [3.0]), _run("single", 1, [3.0], recorded=[]), s)
    assert missing and not any(c.passed for c in missing) and missing[0].detail == "probed steps none, expected 1, 5"
    assert not any(c.passed for c in none_recorded) and "recorded no probes" in none_recorded[0].detail
    late = _run("ddp2", 2, [3.0])
    for o in late.ranks:
        o.result["steps_start"] = 6
    skipped = step_local(late, _run("single", 1, [3.0]), s)
    assert all(c.result == "n/a" and c.value is None for c in skipped)


def test_trajectory_is_judged_against_the_floor_ratio() -> None:
    s = _scenario()
    ref = _run("single", 1, [3.0, 2.5, 2.0])
    twin = _run("twin2", 1, [3.0, 2.5 + 2e-5, 2.0], floor="twin")
    ok = loss_parity(_run("ddp2", 2, [3.0, 2.5, 2.0 + 1e-4]), ref, Floor(twin), s)
    bad = loss_parity(_run("ddp2", 2, [3.0, 2.5, 2.0 + 3e-4]), ref, Floor(twin), s)
    assert ok.passed and ok.floor == pytest.approx(2e-5, rel=1e-6) and ok.limit == pytest.approx(2e-4, rel=1e-6)
    assert ok.ratio == pytest.approx(5, rel=1e-4)
    assert not bad.passed and bad.value == pytest.approx(3e-4, rel=1e-6) and "twin2" in bad.derivation


def test_an_exact_floor_falls_back_to_one_steps_rounding_limit() -> None:
    """A floor run that matches bitwise does not demand bitwise equality from a twin."""
    s = _scenario()
    ref = _run("single", 1, [3.0, 2.0])
    twin = _run("twin2", 1, [3.0, 2.0], floor="twin")
    absolute = rounding(s, ref, _run("ddp2", 2, [3.0, 2.0])).accumulation(1000) * 3.0
    assert absolute == pytest.approx(4 * U_ACC * 10 * 3.0)
    check = loss_parity(_run("ddp2", 2, [3.0 + absolute, 2.0]), ref, Floor(twin), s)
    assert check.passed and check.floor == pytest.approx(absolute)
    assert not loss_parity(_run("ddp2", 2, [3.0 + 11 * absolute, 2.0]), ref, Floor(twin), s).passed


def test_a_bitwise_rerun_demands_a_bitwise_resume() -> None:
    s = _scenario()
    full = _run("single", 1, [3.0, 2.0])
    rerun = _run("single_rerun", 1, [3.0, 2.0], floor="rerun")
    same = loss_parity(_run("ddp2", 2, [3.0, 2.0]), full, Floor(rerun, rerun=True), s)
    off = loss_parity(_run("ddp2", 2, [3.0, 2.0 + 1e-7]), full, Floor(rerun, rerun=True), s)
    assert same.passed and same.limit == 0 and "deterministic" in same.derivation
    assert not off.passed and off.limit == 0


def test_a_bitwise_rerun_on_a_gpu_is_a_draw_not_determinism() -> None:
    """On a GPU (atomic scatter-adds) a rerun that happened to match bitwise leaves the rounding
    of one value as the limit; a real deviation still fails."""
    s = _scenario()
    full = _run("single", 1, [3.0, 2.0], accelerator="cuda")
    rerun = _run("single_rerun", 1, [3.0, 2.0], floor="rerun", accelerator="cuda")
    ulp = _run("ddp2", 2, [3.0, 2.0 + 2.4e-7], accelerator="cuda")
    check = loss_parity(ulp, full, Floor(rerun, rerun=True), s)
    assert check.passed and check.limit > 0 and "deterministic" not in check.derivation
    off = _run("ddp2", 2, [3.0, 2.0 + 1e-4], accelerator="cuda")
    assert not loss_parity(off, full, Floor(rerun, rerun=True), s).passed


def test_a_nondeterministic_rerun_gives_a_floor() -> None:
    s = _scenario()
    full = _run("single", 1, [3.0, 2.0])
    rerun = _run("single_rerun", 1, [3.0, 2.0 + 1e-5], floor="rerun")
    assert loss_parity(_run("ddp2", 2, [3.0 + 5e-5, 2.0]), full, Floor(rerun, rerun=True), s).passed


def test_a_split_floor_is_the_largest_deviation_of_its_draws_of_the_rounding() -> None:
    """Each draw of a split floor is one sample of where rounding puts the trajectory; the floor
    is their largest deviation, point by point, and every draw must have run."""
    s = _scenario()
    ref = _run("single", 1, [3.0, 2.0], params=0.0, evals=2.0)
    draws = [_run("single_split2", 1, [3.0, 2.0 + 1e-5], params=1e-5, evals=2.0, floor="split"),
             _run("single_split2_s2", 1, [3.0 + 4e-5, 2.0], params=4e-5, evals=2.0 + 3e-5, floor="split"),
             _run("single_split2_s3", 1, [3.0, 2.0 + 2e-5], params=2e-5, evals=2.0, floor="split")]
    floor = Floor(draws[0], samples=tuple(draws[1:]))
    run = _run("ddp2", 2, [3.0, 2.0 + 3e-4], params=3e-4, evals=2.0 + 3e-4)
    loss = loss_parity(run, ref, floor, s)
    assert loss.passed and loss.floor == pytest.approx(4e-5, rel=1e-6)  # step 1's draw 2 bounds step 2 as well
    assert "the largest of single_split2, single_split2_s2, single_split2_s3's" in loss.derivation
    params = param_parity(run, ref, floor, s)
    assert params.passed and params.floor == pytest.approx(4e-5, rel=1e-6)
    assert eval_parity(run, ref, floor, s).floor == pytest.approx(4e-5, rel=1e-6)
    # the first draw alone: the same run fails, by the margin a single draw of rounding misjudges
    alone = param_parity(run, ref, Floor(draws[0]), s)
    assert not alone.passed and alone.ratio == pytest.approx(30, rel=1e-6)
    failed = _run("single_split2_s3", 1, [3.0], floor="split")
    failed.ok, failed.failure = False, "rank 0 ended with signal SIGKILL"
    for missing in (Floor(draws[0], samples=(draws[1], None)), Floor(draws[0], samples=(draws[1], failed))):
        check = loss_parity(run, ref, missing, s)
        assert not check.passed and check.limit is None
    assert "single_split2_s3 failed" in loss_parity(run, ref, Floor(draws[0], samples=(failed,)), s).detail


def test_missing_or_refused_floor_fails_and_says_why() -> None:
    s = _scenario()
    ref, run = _run("single", 1, [3.0]), _run("ddp2", 2, [3.0])
    missing = loss_parity(run, ref, Floor(None), s)
    refused = loss_parity(run, ref, Floor(_run("twin2", 1, [3.0]), refused="floor refused: split"), s)
    assert not missing.passed and "no noise-floor run" in missing.detail
    assert not refused.passed and "floor refused" in refused.detail


def test_an_absolute_tolerance_overrides_the_floor() -> None:
    s = _scenario(loss_tolerance=1e-3)
    ref = _run("single", 1, [3.0])
    check = loss_parity(_run("ddp2", 2, [3.0005]), ref, Floor(None, 1e-3, "loss_tolerance"), s)
    assert check.passed and check.limit == 1e-3 and check.floor is None
    assert "loss_tolerance" in check.derivation


def test_param_and_eval_parity_against_the_floor() -> None:
    s = _scenario()
    ref = _run("single", 1, [3.0], evals=2.0)
    twin = _run("twin2", 1, [3.0], params=1e-5, evals=2.0 + 1e-5, floor="twin")
    assert param_parity(_run("ddp2", 2, [3.0], params=5e-5), ref, Floor(twin), s).passed
    bad = param_parity(_run("ddp2", 2, [3.0], params=5e-4), ref, Floor(twin), s)
    assert not bad.passed and bad.value == pytest.approx(5e-4, rel=1e-6) and "relative L2" in bad.detail
    assert eval_parity(_run("ddp2", 2, [3.0], evals=2.0 + 5e-5), ref, Floor(twin), s).passed
    assert not eval_parity(_run("ddp2", 2, [3.0], evals=2.0 + 5e-4), ref, Floor(twin), s).passed


def test_judge_refuses_a_twin_that_is_not_the_references_mathematics() -> None:
    """A model whose result depends on the split: the twin's own step-local check fails."""
    s = _scenario()
    split = [_probe(1, 3.0, 3.0, 0.05), _probe(5, 3.0, 3.0, 0.05)]
    runs = [_run("single", 1, [3.0, 2.0]), _run("ddp2", 2, [3.0, 2.3], probes=split),
            _run("twin2", 1, [3.0, 2.3], probes=split, floor="twin")]
    checks = {c.name: c for c in judge(s, runs) if c.run == "ddp2"}
    assert not checks["loss_parity"].passed and "floor refused: twin2" in checks["loss_parity"].detail
    assert not checks["step_grad_parity"].passed


def _failed(name: str, value: float, limit: float) -> Check:
    return Check(name, "m", False, value, limit)


def test_mutation_caught_names_the_clearest_check() -> None:
    checks = [_failed("loss_parity", 2e-3, 1e-4), _failed("step_grad_parity", 0.5, 1e-6),
              Check("ranks_agree", "m", True, 0, 0)]
    caught = mutation_caught(_run("m", 2, [1.0]), "sum_not_average", checks, 10)
    assert caught.passed and caught.value == pytest.approx(5e5) and "step_grad_parity" in caught.detail
    assert all(c.result == "caught" for c in checks[:2]) and checks[2].result == "pass"


def test_mutation_not_caught_clearly_enough_fails() -> None:
    weak = mutation_caught(_run("m", 2, [1.0]), "mean_of_means", [_failed("loss_parity", 3e-5, 1e-5)], 10)
    none = mutation_caught(_run("m", 2, [1.0]), "mean_of_means", [Check("loss_parity", "m", True, 1e-6, 1e-5)], 10)
    assert not weak.passed and "closest: loss_parity at margin 3" in weak.detail
    assert not none.passed and "not caught" in none.detail


def test_an_exact_criterion_catches_with_infinite_margin() -> None:
    exact = mutation_caught(_run("m", 2, [1.0]), "same_shard", [_failed("step_token_parity", 85, 0)], 10)
    assert exact.passed and math.isinf(exact.value)
    assert exact.to_dict()["value"] is None  # result.json holds no Infinity


def test_step_local_limit_widens_to_the_floor_runs_error_at_the_same_parameters() -> None:
    """TF32: the same mathematics in the run's shapes differs by more than the sums' rounding;
    the twin measures it, and the run may deviate floor_ratio times as much, not more."""
    s = _scenario()
    ref = _run("single", 1, [3.0], u_in=2.0**-11)
    twin = _run("twin2", 1, [3.0], probes=[_probe(1, 3.0, 3.0, 2e-3), _probe(5, 3.0, 3.0, 1e-3)], floor="twin")
    rounding_limit = 4 * (U_ACC * 10 + 2.0**-11 * 2)
    run = _run("ddp2", 2, [3.0], probes=[_probe(1, 3.0, 3.0, 5e-3), _probe(5, 3.0, 3.0, 1e-3)], u_in=2.0**-11)
    alone = next(c for c in step_local(run, ref, s) if c.name == "step_grad_parity")
    assert not alone.passed and alone.limit == pytest.approx(rounding_limit)
    grad = next(c for c in step_local(run, ref, s, twin) if c.name == "step_grad_parity")
    assert grad.passed and grad.limit == pytest.approx(10 * 2e-3) and grad.floor == pytest.approx(2e-3)
    assert "twin2's largest error" in grad.derivation and grad.ratio == pytest.approx(2.5)
    worse = _run("ddp2", 2, [3.0], probes=[_probe(1, 3.0, 3.0, 0.03), _probe(5, 3.0, 3.0, 1e-3)], u_in=2.0**-11)
    assert not next(c for c in step_local(worse, ref, s, twin) if c.name == "step_grad_parity").passed
    # a floor that measured less than rounding leaves the rounding limit
    quiet = _run("twin2", 1, [3.0], probes=[_probe(1, 3.0, 3.0, 1e-5), _probe(5, 3.0, 3.0, 1e-5)], floor="twin")
    assert next(c for c in step_local(run, ref, s, quiet)
                if c.name == "step_grad_parity").limit == pytest.approx(rounding_limit)


def test_an_eval_floor_includes_the_floor_runs_training_loss_drift() -> None:
    """Two eval points are a small sample of the drift: the twin's training-loss deviations up to
    the last eval step count too, and later ones do not."""
    s = _scenario()
    ref = _run("single", 1, [3.0, 2.0, 1.0], evals=2.0)
    twin = _run("twin2", 1, [3.0, 2.0 + 1e-4, 1.0 + 1e-2], evals=2.0 + 1e-6, floor="twin")
    ref.ranks[0].result["evals"] = [{"step": 2, "loss": 2.0, "tokens": 500}]
    twin.ranks[0].result["evals"] = [{"step": 2, "loss": 2.0 + 1e-6, "tokens": 500}]

    def run(delta: float) -> RunOutcome:
        r = _run("ddp2", 2, [3.0, 2.0, 1.0])
        for o in r.ranks:
            o.result["evals"] = [{"step": 2, "loss": 2.0 + delta, "tokens": 500}]
        return r

    check = eval_parity(run(5e-4), ref, Floor(twin), s)
    assert check.passed and check.floor == pytest.approx(1e-4) and "eval or training" in check.derivation
    assert not eval_parity(run(2e-3), ref, Floor(twin), s).passed  # step 3's 1e-2 is after the last eval
