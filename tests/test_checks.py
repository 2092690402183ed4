"""The judge's checks fail on doctored figures, naming the metric, value and limit."""

from __future__ import annotations

import numpy as np
import pytest

from harness.controller.cpu_use import CpuUse
from harness.controller.outcome import RankOutcome, RunOutcome, WatchReport
from harness.controller.rank_budget import Neighbours
from harness.judge.checks import (
    data_share,
    dtype_held,
    expected_failure,
    rank0_side_effects,
    ranks_agree,
    replica_consistency,
    token_accounting,
)
from harness.judge.memory_checks import memory_ceilings
from harness.judge.verdict import judge
from harness.present.tables import runs_table
from harness.run.results import exit_code, median_after_first, per_rank_batch
from harness.scenario import CheckSpec, RunSpec, Scenario, TrainerSpec
from harness.scenario.plan import plan_scenario
from tests.conftest import train_result

MB = 1024 * 1024



def _side_effects(run, trainer):  # noqa: ANN001, ANN202
    from harness.scenario.trainers import trainer_info

    return rank0_side_effects(run, trainer, trainer_info(trainer.kind))

def _run(name: str, ws: int, losses: list[float], digests: list[str], params: float = 0.0,
         rss_mb: float = 100, tokens: list[int] | None = None) -> RunOutcome:
    tokens = tokens or [100 // ws] * ws
    ranks = [
        RankOutcome(r, 0, False, train_result(**{
            "rank": r, "losses": losses, "digests": {"0": digests[r], "4": digests[r]},
            "tokens_local": tokens[r], "tokens_global": sum(tokens), "rss_peak_bytes": int(rss_mb * MB),
            "rss_baseline": "job start", "rss_baseline_bytes": 0, "rss_peak_after_baseline_bytes": int(rss_mb * MB),
            "mlx_peak_bytes": 10 * MB, "runtime_s": 1.0, "tok_s_global": [1.0, 2.0, 3.0], "final_digest": "d",
            "steps": len(losses), "stop": None, "compile": {"mode": "off", "scope": "none", "fallback_reason": None},
            "learning_rates": [1e-3] * len(losses),
            "evals": [{"step": len(losses), "loss": losses[-1] + 0.5, "tokens": 50, "tokens_local": 50 // ws}],
            "side_effects": {"callbacks": len(losses), "log_lines": len(losses), "saves": 1} if r == 0
            else {"callbacks": 0, "log_lines": 0, "saves": 0},
            "data": {"bytes_held": 1000 // ws, "streaming": False}, "global_rng_untouched": True,
        }), [], "")
        for r in range(ws)
    ]
    return RunOutcome(name, ws, "ring", True, None, ranks, WatchReport(2.0, 0),
                      params={"w": np.full((2, 2), params, dtype=np.float32)})


def test_replica_consistency_fails_when_a_rank_differs() -> None:
    assert replica_consistency(_run("d", 2, [1.0], ["a", "a"])).passed
    bad = replica_consistency(_run("d", 2, [1.0], ["a", "b"]))
    assert not bad.passed and bad.value == 2 and "differ at steps 0, 4" in bad.detail


def test_dtype_held_names_the_parameters_that_changed_dtype_and_says_when_it_cannot_decide() -> None:
    run = _run("d", 2, [1.0], ["a", "a"])
    assert dtype_held(run).passed and dtype_held(run).value == 0
    promoted = {"compared": 9, "changed_count": 7, "changed": [[f"layers.{i}.weight", "bfloat16", "float32"]
                                                                for i in range(5)]}
    run.ranks[1].result["dtype_changes"] = promoted
    bad = dtype_held(run)
    assert not bad.passed and bad.value == 7
    assert bad.detail.startswith("7 of 9 parameters ended training in another dtype than they started in (rank 1)")
    assert "layers.0.weight bfloat16 -> float32" in bad.detail and "and 2 more" in bad.detail
    assert "cast each gradient back to its parameter's dtype" in bad.detail
    narrowing = {"compared": 9, "changed_count": 1, "changed": [["w", "float32", "bfloat16"]]}
    run.ranks[0].result["dtype_changes"] = narrowing
    assert dtype_held(run).detail.startswith("1 of 9 parameters ended training in another dtype than they started in "
                                             "(rank 0; 2 ranks in all): w float32 -> bfloat16; a weight narrowed")
    for o in run.ranks:
        o.result["dtype_changes"] = {"compared": 0, "changed_count": 0, "changed": []}
    assert not dtype_held(run).passed and dtype_held(run).detail.startswith("cannot decide: no final parameter")
    run.ranks[0].result["dtype_changes"] = None
    unknown = dtype_held(run)
    assert not unknown.passed and unknown.value is None and unknown.detail.startswith("cannot decide: rank 0")


def test_token_accounting_fails_on_mismatch_with_reference() -> None:
    ref = _run("single", 1, [1.0], ["a"], tokens=[100])
    assert token_accounting(_run("d", 2, [1.0], ["a", "a"], tokens=[60, 40]), ref).passed
    assert not token_accounting(_run("d", 2, [1.0], ["a", "a"], tokens=[60, 41]), ref).passed


def test_memory_ceiling_fails_and_names_the_metric() -> None:
    s = Scenario(name="m", runs=[RunSpec("single", 1), RunSpec("ddp2", 2)],
                 checks=CheckSpec(reference="single", max_rss_mb=150, max_total_rss_mb=250, probe_every=0,
                                  loss_tolerance=1e-5, param_tolerance=1e-4, eval_tolerance=1e-5))
    checks = judge(plan_scenario(s), [_run("single", 1, [1.0], ["a"]), _run("ddp2", 2, [1.0], ["a", "a"], rss_mb=200)])
    failed = {(c.name, c.run) for c in checks if not c.passed}
    assert failed == {("memory_rss_per_rank_mb", "ddp2"), ("memory_rss_total_mb", "ddp2")}


def test_rss_ceilings_count_from_the_baseline_each_rank_reports() -> None:
    """A CUDA rank's RSS counts from the end of its first step (the runtime's kernels are loaded
    then, not the trainer's memory): the same ceiling holds on every device, and growth above the
    baseline still fails it."""
    s = Scenario(name="m", runs=[RunSpec("ddp2", 2)], checks=CheckSpec(max_rss_mb=1024, max_total_rss_mb=1536))
    cuda = _run("ddp2", 2, [1.0], ["a", "a"])
    for o in cuda.ranks:
        o.result.update(rss_baseline="end of step 1", rss_baseline_bytes=1800 * MB,
                        rss_peak_after_baseline_bytes=2300 * MB, rss_peak_bytes=2400 * MB)
    per_rank, total = memory_ceilings(cuda, s)
    assert per_rank.passed and per_rank.value == 500
    assert per_rank.detail == "per rank: 500.0, 500.0 above the RSS baseline (end of step 1: 1800, 1800 MB)"
    assert total.passed and total.value == 1000 and total.detail.startswith("sum of 2 ranks above the RSS baseline")
    cuda.ranks[1].result["rss_peak_after_baseline_bytes"] = 2900 * MB  # a rank that grew 1.1 GB
    per_rank, total = memory_ceilings(cuda, s)
    assert not per_rank.passed and per_rank.value == 1100 and not total.passed


def test_a_memory_figure_a_rank_does_not_report_fails_its_ceiling() -> None:
    s = Scenario(name="m", runs=[RunSpec("ddp2", 2)], checks=CheckSpec(max_rss_mb=1024, max_mlx_mb=64))
    run = _run("ddp2", 2, [1.0], ["a", "a"])
    assert all(c.passed for c in memory_ceilings(run, s))
    del run.ranks[1].result["rss_baseline"]
    run.ranks[0].result["rss_peak_after_baseline_bytes"] = None  # a CUDA rank whose first step never ended
    del run.ranks[0].result["mlx_peak_bytes"]
    rss, mlx = memory_ceilings(run, s)
    assert not rss.passed and rss.value is None
    assert rss.detail == "not reported: rank 0 rss_peak_after_baseline_bytes, rank 1 rss_baseline"
    assert not mlx.passed and mlx.detail == "not reported: rank 0 mlx_peak_bytes"


def test_figures_and_exit_codes() -> None:
    assert median_after_first([100.0, 1.0, 3.0, 2.0]) == 2.0
    assert per_rank_batch(8, 4) == "2" and per_rank_batch(6, 4) == "1-2"
    assert exit_code([{"status": "passed"}]) == 0
    assert exit_code([{"status": "passed"}, {"status": "failed"}]) == 1
    assert exit_code([{"status": "failed"}, {"status": "error"}]) == 3


def _table_run(name: str, ws: int, tok_s: float, global_batch: int = 8, final: float = 2.9) -> dict:
    return {"name": name, "world_size": ws, "per_rank_batch": "1 x 4 accum", "global_batch": global_batch,
            "ok": True, "runtime_s": 1.5, "median_tok_s": tok_s, "avg_loss": 3.2, "final_loss": final,
            "tokens_global": 1000 * ws, "mlx_peak_bytes": [27 * MB] * ws, "rss_peak_bytes": [150 * MB] * ws}


def test_parity_table_shape() -> None:
    scenario = {"reference": "single", "model": "qwen3 0.10M / 160", "runs": [
        _table_run("single", 1, 1234.5), {"name": "ddp2", "world_size": 2, "per_rank_batch": "4", "ok": False}]}
    text = runs_table(scenario)
    assert "Final-loss delta vs single" in text and "Post-step-1 median tok/s" in text
    assert "1234.5" in text and "FAILED" in text and "qwen3 0.10M / 160" in text
    assert "Speed vs" not in text


def test_throughput_table_has_the_guide_shape_columns() -> None:
    scenario = {"reference": "single", "kind": "throughput", "model": "qwen3 0.10M / 160", "runs": [
        _table_run("single", 1, 1000.0, 4), _table_run("ddp2", 2, 1360.0, 8, final=3.1)]}
    text = runs_table(scenario, "github")
    header, _, single, ddp2 = text.splitlines()
    for col in ("Effective global batch", "Tokens", "Speed vs single", "Avg loss", "Final loss",
                "Peak RSS MB per rank"):
        assert col in header
    assert "| 1.00x " in single and "| 1.36x " in ddp2 and "| 2000 " in ddp2 and "| 150 / 150 " in ddp2
    assert "delta" not in header


def test_ranks_agree_fails_when_one_rank_saw_another_stop_or_eval() -> None:
    run = _run("d", 2, [1.0, 0.5], ["a", "a"])
    assert ranks_agree(run).passed
    run.ranks[1].result["stop"] = {"step": 1, "requested_by": [1]}
    run.ranks[1].result["evals"] = [{"step": 2, "loss": 9.0, "tokens": 50}]
    bad = ranks_agree(run)
    assert not bad.passed and bad.value == 2 and "stop, evals" in bad.detail


def test_side_effects_on_a_non_main_rank_fail() -> None:
    ref = TrainerSpec()
    run = _run("d", 2, [1.0], ["a", "a"])
    assert _side_effects(run, ref).passed
    run.ranks[1].result["side_effects"]["saves"] = 1
    bad = _side_effects(run, ref)
    assert not bad.passed and "other ranks: rank 1: callbacks 0, log lines 0, saves 1" in bad.detail
    run = _run("d", 2, [1.0], ["a", "a"])
    run.ranks[0].result["side_effects"]["saves"] = 0  # the reference trainer must have saved
    bad = _side_effects(run, ref)
    assert not bad.passed and "a save on rank 0 demanded: the reference trainer saves its final" in bad.detail
    del run.ranks[1].result["side_effects"]  # not reported: a failure, not zero
    bad = _side_effects(run, ref)
    assert not bad.passed and bad.detail == "rank 1 reported no side-effect counts (side_effects)"


def test_a_save_on_rank_0_is_demanded_only_where_promised() -> None:
    run = _run("d", 2, [1.0], ["a", "a"])
    for r in run.ranks:
        r.result["side_effects"] = {"saves": 0}
    script = TrainerSpec(kind="script", path="t.py")
    ok = _side_effects(run, script)
    assert ok.passed and ok.detail.endswith("not demanded: the script does not declare [trainer] saves")
    assert _side_effects(run, TrainerSpec(kind="script", path="t.py", saves=False)).passed
    bad = _side_effects(run, TrainerSpec(kind="script", path="t.py", saves=True))
    assert not bad.passed and bad.detail.endswith("demanded: the script declares [trainer] saves = true")
    for kind in ("mlx_lm", "mlx_vlm", "unsloth_zoo"):
        assert not _side_effects(run, TrainerSpec(kind=kind)).passed


def test_data_share_fails_when_a_rank_holds_the_whole_dataset() -> None:
    ref = _run("single", 1, [1.0], ["a"])
    assert data_share(_run("d", 2, [1.0], ["a", "a"]), ref, 0.5).passed
    whole = _run("d", 2, [1.0], ["a", "a"])
    whole.ranks[1].result["data"]["bytes_held"] = 1000
    bad = data_share(whole, ref, 0.5)
    assert not bad.passed and bad.value == 1000 and bad.limit == 750
    uneven = data_share(_run("d", 4, [1.0], ["a"] * 4), ref, 0.5, micro_rows=6)  # 2/2/1/1 rows
    assert uneven.limit == 500 and uneven.passed


def test_expected_failure_passes_only_on_the_expected_message() -> None:
    run = _run("d", 2, [1.0], ["a", "a"])
    assert not expected_failure(run, "rank 1 failed").passed  # it passed: unexpected
    run.ok, run.failure = False, "rank 1 failed while fetching a batch at step 2: boom"
    assert expected_failure(run, "rank 1 failed while fetching").passed
    assert not expected_failure(run, "rank 0 failed").passed


def test_cpu_use_counts_other_processes_beyond_the_free_cores() -> None:
    quiet = CpuUse(cores=8, wall_s=2.0, busy_s=4.5, own_s=4.0)
    assert quiet.others_cores == 0.25 and not quiet.disturbed(2)
    busy = CpuUse(cores=8, wall_s=2.0, busy_s=16.0, own_s=4.0)  # 6 other cores: 2 ranks left 6 free
    assert busy.others_cores == 6.0 and not busy.disturbed(2) and busy.disturbed(4)
    assert CpuUse(cores=2, wall_s=1.0, busy_s=2.3, own_s=2.0).disturbed(2)  # 0.3 core on a full machine
    assert CpuUse(cores=2, wall_s=1.0, busy_s=1.9, own_s=2.0).others_cores == 0.0  # rounding: never negative
    assert CpuUse(cores=2, wall_s=0.0, busy_s=1.0, own_s=0.0).others_cores == 0.0


def test_resume_checks_fail_on_doctored_accounting_and_disagreeing_ranks() -> None:
    from harness.judge.resume_checks import resume_accounting, resume_source

    full = _run("full2", 2, [3.0, 2.0, 1.5], ["a", "a"])
    source = _run("part2", 2, [3.0], ["a", "a"])
    resumed = _run("resumed2", 2, [3.0, 2.0, 1.5], ["a", "a"])
    for o in resumed.ranks:
        o.result["resume"] = {"step": 1, "identity": "step-00000001 manifest sha256 ab", "seed_scenario": 9,
                              "seed_checkpoint": 1, "skipped_partials": []}
    source.ranks[0].result["tok_s_global"] = [1.0]
    assert resume_accounting(resumed, full, source, 3.0).passed
    spec = RunSpec("resumed2", 2, resume_from="part2", expect_resume_step=1)
    assert resume_source(resumed, spec).passed

    source.ranks[0].result["tok_s_global"] = [7.0]  # re-measured instead of restored
    bad = resume_accounting(resumed, full, source, 3.0)
    assert not bad.passed and "restored tok/s of steps 1-1 differ from part2's" in bad.detail
    slow = _run("resumed2", 2, [3.0, 2.0, 1.5], ["a", "a"], tokens=[50, 49])
    for o in slow.ranks:
        o.result["tok_s_global"] = [0.1, 0.2, 0.3]
    bad = resume_accounting(slow, full, None, 3.0)
    assert not bad.passed and "tokens_global differs" in bad.detail and bad.value == 0.1
    # fast restored history, slow new steps: judged on the steps it trained (2-4), not the history
    later = _run("resumed2", 2, [3.0, 2.0, 1.5, 1.2], ["a", "a"])
    steady = _run("full2", 2, [3.0, 2.0, 1.5, 1.2], ["a", "a"])
    for o in later.ranks:
        o.result["tok_s_global"], o.result["resume"] = [9.0, 0.5, 0.4, 0.6], {"step": 1}
    for o in steady.ranks:
        o.result["tok_s_global"] = [9.0, 9.0, 8.0, 9.5]
    bad = resume_accounting(later, steady, None, 3.0)
    assert not bad.passed and "fastest tok/s 0.6 vs 9.5" in bad.detail and "steps 3-4" in bad.detail
    later.watch.cpu = CpuUse(cores=2, wall_s=10.0, busy_s=20.4, own_s=20.0)  # others: 0.04 cores
    assert not resume_accounting(later, steady, None, 3.0).passed
    later.watch.cpu = CpuUse(cores=2, wall_s=10.0, busy_s=19.9, own_s=5.0)  # another job: 1.49 cores
    shown = resume_accounting(later, steady, None, 3.0)
    assert shown.passed and shown.value == round(0.6 / 9.5, 3)
    assert "(not compared: during resumed2 other processes kept 1.49 of 2 CPUs busy (its 2 ranks left 0 free))" \
        in shown.detail
    steady.watch.cpu, later.watch.cpu = later.watch.cpu, None  # the target's run was the disturbed one
    assert "during full2" in resume_accounting(later, steady, None, 3.0).detail
    steady.watch.cpu = None
    later.watch.neighbours = Neighbours(samples=6, shared=6, most=6)  # other launches beside it all along
    assert not resume_accounting(later, steady, None, 3.0).passed  # on the CPU: the rank budget keeps them apart
    for o in later.ranks:
        o.result["accelerator"] = "cuda"  # on a GPU they shared its device
    shown = resume_accounting(later, steady, None, 3.0)
    assert shown.passed and ("(not compared: during resumed2 on the cuda GPU other launches held rank slots for "
                             "100% of it (up to 6 at once))") in shown.detail
    later.watch.neighbours = Neighbours(samples=6, shared=3, most=6)  # alone for half of it: judged
    assert not resume_accounting(later, steady, None, 3.0).passed
    later.watch.neighbours = None
    for o in later.ranks:
        o.result["tok_s_global"] = [9.0, 2.0, 3.5, 9.1]  # one undisturbed step is enough
    assert resume_accounting(later, steady, None, 3.0).passed
    resumed.ranks[1].result["resume"] = {**resumed.ranks[0].result["resume"], "identity": "step-2", "step": 2}
    bad = resume_source(resumed, spec)
    assert not bad.passed and "ranks resumed from different checkpoints" in bad.detail


def test_every_check_family_has_a_judge_and_a_family_registers_once() -> None:
    from harness.judge.verdict import judge_of
    from harness.scenario import checks as check_plan

    assert all(callable(judge_of(f)) for f in check_plan.families())
    names = check_plan.check_names()
    assert len(set(names)) == len(names) and set(check_plan.CheckName) <= set(names)
    assert check_plan.families()[-1].name == "mutation"  # judged last: it reads the others' checks
    with pytest.raises(ValueError, match="registered twice"):
        check_plan.register(check_plan.CheckFamily("memory", ("x",), lambda s, spec: [], "m:f", "doc"))
    with pytest.raises(ValueError, match="loss_parity already registered"):
        check_plan.register(check_plan.CheckFamily("again", ("loss_parity",), lambda s, spec: [], "m:f", "doc"))
    assert "again" not in {f.name for f in check_plan.families()}


def test_a_planned_check_the_results_cannot_measure_is_na_saying_why() -> None:
    s = Scenario(name="t", checks=CheckSpec(reference="single"), runs=[RunSpec("single", 1), RunSpec("ddp2", 2)])
    single, ddp2 = _run("single", 1, [3.0, 2.0], ["a"]), _run("ddp2", 2, [3.0, 2.0], ["a", "a"])
    single.ok = False  # the reference did not complete: ddp2's parity checks are planned, not measured
    got = {c.name: c for c in judge(plan_scenario(s), [single, ddp2]) if c.run == "ddp2"}
    loss = got["loss_parity"]
    assert not loss.applicable and "the reference run single did not complete" in loss.detail
    assert got["token_accounting"].applicable


def test_checks_that_compare_ranks_are_not_applicable_at_one_rank() -> None:
    """At one rank replica_consistency and ranks_agree have nothing to compare: n/a, never a pass
    that could not have failed; at two ranks they are judged."""
    for check in (replica_consistency, ranks_agree):
        one, two = check(_run("single", 1, [1.0], ["a"])), check(_run("ddp2", 2, [1.0], ["a", "a"]))
        assert one.result == "n/a" and one.detail == "not applicable: one rank, no other to compare it with"
        assert two.applicable and two.result == "pass" and two.detail.startswith("2 ranks")
