"""Verdicts in bfloat16, in pure logic: a trajectory check without power is INCONCLUSIVE where the
runs were shown to start alike and a failure where they were not; a scenario with one is
INCONCLUSIVE (exit 4); the split floor deals rows to chunks as ranks hold them and carries an
output's gradient at a rank's own loss scale; the dtype a rank computes in is the coarsest of its
weights'. Real ranks: tests/test_scenarios.py and
tests/test_defect_naming.py."""

from __future__ import annotations

import numpy as np

from harness.controller.outcome import RankOutcome, RunOutcome, WatchReport
from harness.exit_codes import EXIT_CHECK_FAILED, EXIT_INCONCLUSIVE, EXIT_PASS
from harness.judge.checks import Check
from harness.judge.power import judge_power
from harness.present.report import summary_lines
from harness.run.results import exit_code

PRECISION = {"dtype": "bfloat16", "label": "bfloat16", "u_in": 2.0**-8, "u_dtype": 2.0**-8}


def outcome(name: str, losses: list[float], moved: float | None = 0.4) -> RunOutcome:
    result = {"losses": losses, "precision": PRECISION}
    return RunOutcome(name, 1, None, True, None, [RankOutcome(0, 0, False, result, [], "")], WatchReport(1.0, 0),
                      moved=moved)


def trajectory(limit: float, noise: float | None = None) -> Check:
    """A passing loss_parity whose limit is 10 x max(noise, an absolute floor of 1e-3)."""
    floor = max(noise or 0.0, 1e-3)
    return Check("loss_parity", "ddp2", True, 0.01, limit, "vs single: 4 steps", floor=floor,
                 noise=noise)


def start(applicable: bool = True, passed: bool = True) -> Check:
    detail = "3 starts equal to single's, bitwise" if applicable else "not applicable: ddp2 never said what " \
                                                                       "training starts from"
    return Check("start_parity", "ddp2", passed, 0, 0, detail, applicable=applicable)


def judged(check: Check, start_check: Check, moved_loss: float = 1.0) -> Check:
    run, base = outcome("ddp2", [5.0, 4.5, 4.2, 4.0]), outcome("single", [5.0, 5.0 - moved_loss / 2, 5.0 - moved_loss])
    (out,) = judge_power([check], run, base, start_check)
    return out


def test_a_limit_over_half_of_what_training_moved_is_inconclusive_from_a_compared_start() -> None:
    c = judged(trajectory(limit=0.6, noise=0.06), start())
    assert c.result == "INCONCLUSIVE" and c.passed and c.inconclusive and c.no_power
    assert c.detail.startswith("no power: the floor runs (the same mathematics in another rounding) drifted")
    assert "more steps or a larger learning rate" in c.detail and "seeded" not in c.detail
    lifted = judged(trajectory(limit=0.6), start())  # the absolute floor alone set it: inconclusive too
    assert lifted.result == "INCONCLUSIVE" and "set by the absolute floor" in lifted.detail


def test_a_limit_at_most_half_has_power_and_passes() -> None:
    c = judged(trajectory(limit=0.5, noise=0.05), start())
    assert c.result == "pass" and not c.no_power


def test_without_a_compared_start_a_check_without_power_fails() -> None:
    c = judged(trajectory(limit=0.6, noise=0.06), start(applicable=False))
    assert c.result == "FAIL" and not c.passed and c.no_power
    assert "so the runs may not start alike either" in c.detail
    apart = judged(trajectory(limit=0.01, noise=0.001), start(passed=False))  # with power, but starts differ
    assert apart.result == "FAIL" and "seed the model" in apart.detail


def test_a_scenario_with_an_inconclusive_check_exits_4_unless_another_failed() -> None:
    assert exit_code([{"status": "passed"}, {"status": "inconclusive"}]) == EXIT_INCONCLUSIVE == 4
    assert exit_code([{"status": "failed"}, {"status": "inconclusive"}]) == EXIT_CHECK_FAILED
    assert exit_code([{"status": "passed"}]) == EXIT_PASS
    c = judged(trajectory(limit=0.6, noise=0.06), start()).to_dict()
    doc = {"scenarios": [{"name": "s", "status": "inconclusive", "checks": [c]}], "exit_code": 4}
    lines = summary_lines(doc, None)
    assert lines[0].startswith("summary: 1 scenario: 0 passed, 0 failed, 1 inconclusive, ")
    assert "1 INCONCLUSIVE (no power)" in lines[0] and lines[0].endswith("exit 4")
    assert lines[1].startswith("inconclusive: s: loss_parity (ddp2): no power: ")


def test_the_split_floor_deals_rows_as_ranks_hold_them() -> None:
    from harness.rank.split_floor import chunk_rows

    assert chunk_rows(5, 2) == [[0, 2, 4], [1, 3]]
    assert chunk_rows(3, 4) == [[0], [1], [2]]  # no chunk empty
    assert chunk_rows(4, 1) == [[0, 1, 2, 3]]


def test_the_dtype_seen_is_the_coarsest_of_the_weights_frozen_ones_included() -> None:
    import mlx.core as mx

    from harness.rank.precision import coarsest_dtype, measure_precision

    lora = {"base": mx.zeros((2, 2), dtype=mx.bfloat16), "adapter": mx.zeros((2,), dtype=mx.float32),
            "ids": mx.zeros((2,), dtype=mx.int32)}
    assert coarsest_dtype(lora) == "bfloat16"
    assert coarsest_dtype({"w": mx.zeros((1,))}) == "float32"
    assert coarsest_dtype({"ids": mx.zeros((1,), dtype=mx.int32)}) is None
    label = measure_precision("bfloat16", "float32")["label"]
    assert label == "bfloat16 (seen in the weights; [model] dtype is float32)"
    assert measure_precision("float32", "float32")["label"] == "float32"
    assert measure_precision("bfloat16")["label"] == "bfloat16"  # no [model] dtype declared: nothing disagrees


def test_a_model_dtype_left_out_is_none_and_builds_float32() -> None:
    from harness.rank.models import build_model
    from harness.rank.precision import coarsest_dtype
    from harness.scenario.spec import ModelSpec

    assert ModelSpec().dtype is None  # a script's weights say their dtype
    model, _ = build_model(ModelSpec(config={"num_hidden_layers": 1}), 64, 0)
    assert coarsest_dtype(model.parameters()) == "float32"


def test_lora_adapters_are_compared_by_the_update_they_make() -> None:
    import numpy as np

    from harness.controller import params

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((6, 2)), rng.standard_normal((2, 5))
    m = np.array([[2.0, 1.0], [0.5, 3.0]])  # another basis of the rank dimension: the same product
    ref = {"l.lora_a": a, "l.lora_b": b, "norm": np.ones(3)}
    turned = {"l.lora_a": a @ m, "l.lora_b": np.linalg.solve(m, b), "norm": np.ones(3)}
    value, _, _ = params.param_delta(turned, ref)
    assert value < 1e-12
    moved = dict(ref, **{"l.lora_b": b * 1.01})
    value, biggest, where = params.param_delta(moved, ref)
    assert abs(value - 0.01 * np.linalg.norm(a @ b) / np.sqrt(np.sum((a @ b) ** 2) + 3)) < 1e-9
    assert where == "l.lora_a @ lora_b" and biggest > 0
    old, params.PRODUCT_ELEMENTS = params.PRODUCT_ELEMENTS, 0  # the r x r traces give the same distance
    try:
        assert abs(params.param_delta(moved, ref)[0] - value) < 1e-9
    finally:
        params.PRODUCT_ELEMENTS = old


def test_a_tensor_is_compared_in_slices_as_over_its_whole(monkeypatch) -> None:
    from harness.controller import params

    rng = np.random.default_rng(2)
    ref = {"w": rng.standard_normal((5, 9)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32),
           "empty": np.zeros((0, 3), np.float32)}
    other = {k: (v + 1e-4 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in ref.items()}
    whole = params.param_delta(other, ref)
    monkeypatch.setattr(params, "CHUNK", 7)  # slices that end inside a row, the last one short
    value, biggest, where = params.param_delta(other, ref)
    d = {k: other[k].astype(np.float64) - ref[k].astype(np.float64) for k in ref}
    expected = np.sqrt(sum(np.sum(x * x) for x in d.values()) / sum(np.sum(ref[k].astype(np.float64) ** 2)
                                                                   for k in ref))
    assert abs(value - expected) < 1e-12 * expected and abs(whole[0] - expected) < 1e-12 * expected
    assert where == max(("w", "b"), key=lambda k: np.max(np.abs(d[k]))) and biggest == whole[1] == max(
        float(np.max(np.abs(d[k]))) for k in ("w", "b"))
    other["w"][4, 8] = np.nan  # in the last, short slice
    assert np.isnan(params.param_delta(other, ref)[0])


def test_expert_stacked_lora_factors_are_compared_element_by_element() -> None:
    import numpy as np

    from harness.controller import params

    rng = np.random.default_rng(1)  # mlx-lm's LoRASwitchLinear: lora_a (E, r, in), lora_b (E, out, r)
    ref = {"moe.lora_a": rng.standard_normal((4, 2, 6)), "moe.lora_b": rng.standard_normal((4, 5, 2))}
    other = {k: v * 1.01 for k, v in ref.items()}
    value, _, where = params.param_delta(other, ref)
    assert abs(value - 0.01) < 1e-9 and where in ref


def test_a_training_that_diverged_is_named_for_it() -> None:
    from harness.judge.parity import non_finite

    nan, inf = float("nan"), float("inf")
    assert non_finite((("ddp2", [1.0, 2.0]), ("single", [1.0, 2.0]))) is None
    assert non_finite((("ddp2", [1.0, nan, nan]), ("single", [1.0, 2.0, 3.0]))) == \
        "not finite: ddp2's loss is nan from step 2"
    both = non_finite((("ddp2", [inf, nan]), ("single", [1.0, nan])), skip=4)
    assert both == ("not finite: ddp2's loss is inf from step 5; single's loss is nan from step 6; the training "
                    "diverges in one process too")
    import numpy as np

    from harness.controller.params import param_delta

    value, _, where = param_delta({"w": np.array([1.0, np.nan])}, {"w": np.array([1.0, 2.0])})
    assert np.isnan(value) and where == "w"  # not a distance of 0: NaN compared is no match


def _output_gradient(sizes: list[int], supervised: list[int], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The gradient of a loss (a supervised token sum over the call's total, as one process scales
    it) at logits of ``sizes`` chunks of rows, plain and through ``rank_scaled_outputs``."""
    import mlx.core as mx

    from harness.rank.split_floor import rank_scaled_outputs

    rows, width, vocab = sum(sizes), 6, 5
    logits = mx.random.normal((rows, width, vocab), key=mx.random.key(3)).astype(getattr(mx, dtype))
    mask = np.zeros((rows, width), np.float32)
    at = 0
    for size, n in zip(sizes, supervised, strict=True):
        mask[at:at + size].reshape(-1)[:n] = 1  # n supervised positions in this chunk
        at += size
    mask_ = mx.array(mask)

    def loss(x: mx.array) -> mx.array:
        return ((mx.logsumexp(x.astype(mx.float32), axis=-1)) * mask_).sum() / mask_.sum()

    def scaled(x: mx.array) -> mx.array:
        return loss(rank_scaled_outputs(x, sizes))

    plain = mx.grad(loss)(logits).astype(mx.float32)
    ranked = mx.grad(scaled)(logits).astype(mx.float32)
    return np.array(plain), np.array(ranked)


def test_a_rank_scaled_output_gradient_is_exact_where_the_ranks_scale_is_a_power_of_two() -> None:
    plain, ranked = _output_gradient([2, 2], [5, 5], "bfloat16")  # each chunk T / n = 2: exact on the ranks
    assert np.array_equal(plain, ranked)


def test_a_rank_scaled_output_gradient_rounds_where_the_ranks_scale_is_not() -> None:
    plain, ranked = _output_gradient([2, 2, 2], [5, 3, 4], "bfloat16")  # T / n = 12/5, 4, 3
    moved = np.abs(ranked - plain)[plain != 0] / np.abs(plain[plain != 0])
    assert 0 < moved.max() <= 2 * 2.0**-8  # rounded, by at most two roundings of bfloat16
    assert np.array_equal(ranked[2:4], plain[2:4])  # the chunk at scale 4 is exact


def test_more_steps_are_not_offered_where_the_loss_levelled_off() -> None:
    from harness.judge.power import remedy

    levelled = [5.5, 5.3, 5.2, 5.2, 5.15, 5.12, 5.1, 5.1]  # moved 0.35 by step 5, 0.4 in all
    said = remedy(levelled, "float32")
    assert said.startswith("float32 would give it power; more steps would not") and "0.35" in said
    falling = [5.0, 4.6, 4.2, 3.8, 3.4, 3.0, 2.6, 2.2]
    assert remedy(falling, "float32") == ("more steps or a larger learning rate (training moving further), or "
                                          "float32, would give it power")


def test_a_run_at_float32_is_not_offered_float32() -> None:
    """At float32 the remedy offers no wider dtype (TF32 matmuls: float32 without them); runs of
    several precisions are offered what the narrowest of them lacks."""
    from harness.judge.power import remedy, wider

    def at(dtype: str, tf32: bool = False) -> RunOutcome:
        run = outcome("ddp2", [5.0, 4.5])
        run.ranks[0].result["precision"] = {**PRECISION, "dtype": dtype, "tf32": tf32}
        return run

    levelled, falling = [5.5, 5.3, 5.2, 5.2, 5.15, 5.12, 5.1, 5.1], [5.0, 4.6, 4.2, 3.8, 3.4, 3.0, 2.6, 2.2]
    said = remedy(levelled, wider(at("float32"), at("float32")))
    assert said.startswith("training that moves further than rounding grows would give it power") and \
        "float32" not in said.split(";")[0], said
    assert remedy(falling, wider(at("float32"))) == ("more steps or a larger learning rate (training moving further) "
                                                     "would give it power")
    tf32 = remedy(levelled, wider(at("float32", tf32=True), at("float32")))
    assert tf32.startswith("float32 without TF32 matmuls (MLX_ENABLE_TF32=0) would give it power"), tf32
    for mixed in ((at("float32"), at("bfloat16")), (at("bfloat16"), at("float32")),
                  (at("bfloat16"), at("float32", tf32=True))):
        assert remedy(levelled, wider(*mixed)).startswith("float32 would give it power"), mixed


def test_a_floor_that_diverged_where_the_run_did_not_is_named_and_judges_nothing() -> None:
    from harness.judge.parity import Floor, _judge_series

    nan = float("nan")
    run, base = outcome("ddp2", [5.0, 4.5, 4.2]), outcome("single", [5.0, 4.5, 4.2])
    floor_run = outcome("single_split2", [5.0, nan, nan])
    c = _judge_series("loss_parity", run, base, ["step 1", "step 2", "step 3"], [0.0, 0.01, 0.02],
                      [0.0, nan, nan], [1e-6] * 3, Floor(run=floor_run), None, "3 steps")  # type: ignore[arg-type]
    assert not c.passed and c.limit is None
    assert c.detail == ("vs single: the noise floor diverged where ddp2 did not (single_split2's loss is nan "
                        "from step 2)")
