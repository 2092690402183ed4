"""Every shipped scenario passes end to end through the CLI, with real ranks, and proves its behaviour.

Each scenario's own checks carry the tolerances (stated in the scenario files); the assertions here
check that the behaviour the scenario is about was really exercised (a fallback happened, a stop
was seen at step 4 by every rank, every fault produced its rank-specific messages, ...).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.present.tables import runs_table
from harness.scenario.trainers import trainer_info
from tests.conftest import REPO, SharedRun, cli, full_set, needs_unsloth

pytestmark = pytest.mark.ranks


PARITY = ("step_loss_parity", "step_grad_parity", "loss_parity", "param_parity", "eval_parity",
          "resume_loss_parity", "resume_param_parity", "resume_eval_parity")
MARGIN = 3  # a correct run passes every parity check with value <= limit / 3


POWER = REPO / "scenarios" / "power"  # a default scenario with every collective mutation planted


def shared_with_power(name: str) -> list[str] | None:
    """The runs of ``scenarios/<name>.toml`` where ``scenarios/power/<name>.toml`` plans every one of
    them alike: the same job (the scenario's name, path, description, run list and mutation opt-in
    aside) and the same checks; else None. One run of the power scenario then answers both its test
    (``tests/test_collective_mutations.py``) and the shipped scenario's."""
    if not (POWER / f"{name}.toml").exists():
        return None
    from harness.scenario import load_scenario
    from harness.scenario.plan import plan_scenario

    def planned(path: Path) -> dict[str, tuple[dict, list[str]]]:
        out = {}
        for r in plan_scenario(load_scenario(path)).runs:
            job = r.job.to_json()
            identity = ("name", "path", "description", "runs", "default", "full")  # which set it is in
            scenario = {k: v for k, v in job.pop("scenario").items() if k not in identity}
            scenario["checks"] = {k: v for k, v in scenario["checks"].items() if k != "mutations"}
            out[r.name] = ({**job, "scenario": scenario}, r.check_names)
        return out

    shipped, power = planned(REPO / "scenarios" / f"{name}.toml"), planned(POWER / f"{name}.toml")
    return list(shipped) if all(power.get(run) == plan for run, plan in shipped.items()) else None


def _run(name: str, out: Path, shared_run: SharedRun, power: bool) -> tuple[dict[str, Any], dict[str, dict],
                                                                           dict[tuple[str, str], dict]]:
    """``power``: the power set runs in this session (``pytest --all``), so its run is read where it
    holds this scenario's runs; else the shipped scenario runs, at half the power scenario's cost."""
    shared = shared_with_power(name) if power else None
    if shared is None:
        p = cli("run", str(REPO / "scenarios" / f"{name}.toml"), "--out", str(out))
    else:  # the power scenario's run, read for the shipped scenario's runs
        p, out = shared_run(str(POWER / f"{name}.toml"))
    assert (out / "result.json").is_file(), f"exit {p.returncode}: " + p.stdout[-3000:] + p.stderr[-3000:]
    (s,) = json.loads((out / "result.json").read_text())["scenarios"]
    said = {c["name"] for c in s["checks"] if c["result"] == "INCONCLUSIVE"}
    undecided = name in INCONCLUSIVE or bool(said)
    assert said <= INCONCLUSIVE.get(name, set()) | MAY_NOT_DECIDE.get(name, set()), said
    assert p.returncode == (4 if undecided else 0), p.stdout[-4000:] + p.stderr[-2000:]
    assert s["status"] == ("inconclusive" if undecided else "passed") and all(c["passed"] for c in s["checks"])
    runs = {r["name"]: r for r in s["runs"] if shared is None or r["name"] in shared}
    checks = {(c["name"], c["run"]): c for c in s["checks"] if shared is None or c["run"] in shared}
    assert shared is None or set(runs) == set(shared)
    for c in checks.values():  # untuned criteria, and yet a clear pass: a margin of 3 or more
        if c["name"] in PARITY and c["result"] == "pass":
            assert c["derivation"], c
            margin = THIN.get((name, c["name"]), MARGIN)
            assert c["value"] * margin <= c["limit"] or c["value"] == c["limit"] == 0, c
    return s, runs, checks


# LoRA adapters trained a few AdamW steps on a tiny model with random weights: rounding grows
# chaotically over the steps about as far as training moves the adapters (docs/parity.md#power)
INCONCLUSIVE: dict[str, set[str]] = {}
# Decided on some CPUs and not on others: OpenBLAS picks its kernels by CPU, so the rounding differs,
# and AdamW on LoRA adapters grows it chaotically (float32 INCONCLUSIVE in 9 of 20 seeds,
# docs/parity.md#bfloat16): at the shipped seed the check passed on one machine and read INCONCLUSIVE
# on an AMD EPYC. Either is allowed; a FAIL never is.
MAY_NOT_DECIDE: dict[str, set[str]] = {"mlx_lm_lora": {"param_parity"}}
# LoRA adapters (lora_b starting at zero, AdamW): in float32 their deviation over its floor spread
# from 0.19 to 3.56 over 20 seeds (docs/parity.md#bfloat16), so a margin of 3 at one seed is not what
# the floor promises there; the check's own limit (10 x the floor) is
THIN = {("mlx_lm_lora", "param_parity"): 2}


def compile_modes(runs: dict, checks: dict, out: Path) -> None:
    scopes = {n: checks[("compile_scope", n)]["value"] for n in ("eager2", "compiled2", "compiled1", "fallback2")}
    assert scopes == {"eager2": "none", "compiled2": "full-step", "compiled1": "full-step",
                      "fallback2": "fallback-eager"}
    reason = runs["fallback2"]["compile"]["fallback_reason"]
    assert reason.startswith("rank 1 failed while compiling the local step at step 3: ValueError: [eval]"), reason
    assert checks[("compile_scope", "fallback1")]["value"] == "fallback-eager"  # one rank: its state undone
    reason = runs["fallback1"]["compile"]["fallback_reason"]
    assert reason.startswith("rank 0 failed while compiling the local step at step 3: ValueError: [eval]"), reason
    assert checks[("loss_parity", "fallback1")]["passed"], checks[("loss_parity", "fallback1")]
    assert checks[("loss_parity", "compiled2")]["value"] == 0.0  # same kernels, same order: same bits
    assert checks[("loss_parity", "fallback2")]["value"] <= 1e-5
    strict = runs["strict_fails"]["failure"]
    assert "rank 0: a peer rank failed: rank 1 failed while compiling the local step at step 3" in strict
    model = runs["model_error"]["failure"]
    assert "injected error in the model's forward" in model and "compil" not in model.lower()
    assert "rank 0: a peer rank failed: rank 1 failed while running a training step" in model


def failure_consensus(runs: dict, checks: dict, out: Path) -> None:
    cause = {"fetch": 1, "step": 1, "update": 0, "eval": 1, "save": 0}
    for name, rank in cause.items():
        failure = runs[name]["failure"]
        lines = failure.splitlines()
        assert lines[0].startswith(f"rank {rank} failed while "), failure
        assert f"rank {1 - rank}: a peer rank failed: rank {rank} failed while" in failure, failure
        assert "watchdog" not in failure and not checks[("expected_failure", name)]["detail"].endswith("hang")
        assert runs[name]["wall_s"] < 30  # nobody waited for a limit
    zero = runs["zero_tokens"]["failure"].splitlines()
    assert zero == [f"rank {r} failed: step 1: the global batch has zero supervised tokens across all 2 ranks"
                    for r in (0, 1)]


def early_stop(runs: dict, checks: dict, out: Path) -> None:
    for name, who in (("single", [0]), ("ddp2_step", [1]), ("ddp2_eval", [1])):
        assert runs[name]["steps"] == 4 and runs[name]["stop"] == {"step": 4, "requested_by": who}
        assert checks[("stop_step", name)]["value"] == 4
    assert [e["step"] for e in runs["ddp2_eval"]["evals"]] == [2, 4]


def streaming(runs: dict, checks: dict, out: Path) -> None:
    assert checks[("loss_parity", "stream1")]["value"] == 0.0  # same batches, same process: same bits
    whole = runs["materialized"]["data"][0]["bytes_held"]
    for name in ("stream1", "stream2", "stream4"):
        data = runs[name]["data"]
        assert all(d["streaming"] and d["rows_held"] is None for d in data)
        assert all(d["bytes_held"] < whole / 2 for d in data)  # two global batches at most, not the dataset
    _bitwise_resume(runs, checks, "stream2_resumed", "stream2", 6)
    # the resumed ranks read past the trained batches: they read the same rows as the uninterrupted run
    read = [[d["rows_read"] for d in runs[n]["data"]] for n in ("stream2_resumed", "stream2")]
    assert read[0] == read[1]


def response_only(runs: dict, checks: dict, out: Path) -> None:
    held = [d["bytes_held"] for d in runs["ddp4"]["data"]]
    assert checks[("data_share_bytes", "ddp4")]["value"] == max(held)
    assert max(held) < runs["single"]["data"][0]["bytes_held"] / 2
    assert runs["ddp4"]["per_rank_batch"] == "1-2"
    ranks = runs["ddp4"]["ranks"]
    assert len({r["tokens_local"] for r in ranks}) > 1  # ranks see different token counts


def grad_accum(runs: dict, checks: dict, out: Path) -> None:
    assert runs["ddp2_accum4"]["per_rank_batch"] == "1 x 4 accum"
    for name in ("ddp2_accum2", "ddp2_accum4", "ddp4_accum2"):
        assert checks[("loss_parity", name)]["value"] <= 1e-5


def chat_jsonl(runs: dict, checks: dict, out: Path) -> None:
    assert checks[("loss_parity", "ddp2")]["passed"] and runs["single"]["losses"][-1] < runs["single"]["losses"][0]


def _bitwise_resume(runs: dict, checks: dict, resumed: str, full: str, step: int) -> None:
    names = ["resume_loss_parity", "resume_param_parity"] + (["resume_eval_parity"] if runs[full]["evals"] else [])
    for name in names:
        assert checks[(name, resumed)]["value"] == 0.0 and checks[(name, resumed)]["limit"] == 0.0
    a, b = runs[resumed], runs[full]
    for key in ("losses", "final_digest", "evals", "tokens_global", "tokens_global_per_step", "grad_norms",
                "learning_rates"):
        assert a[key] == b[key], key
    assert a["steps_start"] == step + 1 and checks[("resume_step", resumed)]["value"] == step
    assert [r["tokens_local"] for r in a["ranks"]] == [r["tokens_local"] for r in b["ranks"]]


def resume_parity(runs: dict, checks: dict, out: Path) -> None:
    for n in (1, 2, 4):
        part, resumed = runs[f"part{n}"], runs[f"resumed{n}"]
        _bitwise_resume(runs, checks, f"resumed{n}", f"full{n}", 6)
        assert part["steps"] == 6 and [c["step"] for c in part["checkpoints"]] == [4, 6]
        assert resumed["resume"]["seed_scenario"] == 99 and resumed["seed_used"] == 4321  # the checkpoint's seed
        assert resumed["tok_s_global"][:6] == part["tok_s_global"]  # restored, not re-measured
        # the resumed run checkpoints at 8, 12, 16 into its own directory, keeping the newest 2
        assert [(c["step"], c["removed"]) for c in resumed["checkpoints"]] == [
            (8, []), (12, []), (16, ["step-00000008"])]
        kept = out / "runs" / "resume_parity" / f"part{n}" / "checkpoints" / "step-00000006"
        assert sorted(p.name for p in kept.iterdir()) == ["manifest.json", "trainer.json"]
    report = (out / "report.md").read_text()
    assert "### Resume" in report and "| resumed4 " in report and "part4 @ step 6" in report


def memory_runaway(runs: dict, checks: dict, out: Path) -> None:
    line = runs["runaway"]["failure"].splitlines()[0]
    head = "watchdog: rank 1 exceeded its hard memory limit after step 1: "
    assert line.startswith(head), line
    figure = "rss" if line.startswith(head + "RSS ") else "mlx"  # whichever passed its limit first
    assert figure == "rss" or line.startswith(head + "MLX memory "), line
    value = float(line[len(head):].split(" MB")[0].split()[-1])
    assert 600 <= value < 1200, line  # the line rounds to whole MB
    assert f"limit 600 MB (3 x the ceiling [checks] max_{figure}_mb = 200)" in line, line
    for figure in ("rss", "mlx"):
        assert checks[(f"memory_{figure}_per_rank_mb", "within")]["passed"]
        assert checks[(f"memory_{figure}_per_rank_mb", "within")]["value"] < 200
    assert "above the RSS baseline (" in checks[("memory_rss_per_rank_mb", "within")]["detail"]


def speed_gate(runs: dict, checks: dict, out: Path) -> None:
    for name in ("single", "ddp2"):
        assert runs[name]["steps"] == 40 and runs[name]["median_tok_s"] > 0
    assert checks[("replica_consistency", "ddp2")]["passed"]


def resume_after_kill(runs: dict, checks: dict, out: Path) -> None:
    assert runs["killed2"]["failure"].splitlines()[0] == "rank 1 ended with signal SIGKILL after step 9"
    _bitwise_resume(runs, checks, "after_kill2", "full2", 8)
    # rank 0 died inside the step-8 write: that checkpoint never became complete, and was skipped
    assert runs["write_killed2"]["failure"].splitlines()[0] == "rank 0 ended with signal SIGKILL after step 8"
    _bitwise_resume(runs, checks, "after_write_kill2", "full2", 4)
    skipped = runs["after_write_kill2"]["resume"]["skipped_partials"]
    assert len(skipped) == 1 and skipped[0].startswith(".partial-step-00000008-")
    kept = out / "runs" / "resume_after_kill" / "write_killed2" / "checkpoints"
    assert sorted(p.name for p in kept.iterdir()) == ["step-00000004"]  # only manifests of complete ones


def resume_validation(runs: dict, checks: dict, out: Path) -> None:
    refused = runs["refuse_corrupt"]["failure"].splitlines()
    assert len(refused) == 2 and all("/part2/checkpoints/step-00000008/optimizer.safetensors: SHA-256" in line
                                     for line in refused)
    _bitwise_resume(runs, checks, "from_previous", "full2", 4)
    for name, twin in (("to4", "twin4_of_full2"), ("to1_accum", "twin1_accum2_of_full2")):
        # another world size: not bitwise, judged like parity against a twin of full2 in its own shape
        assert runs[name]["resume"]["world_size_changed"] and not runs[name]["resume"]["local_tokens_restored"]
        c = checks[("resume_loss_parity", name)]
        assert 0 < c["value"] and c["floor"] > 0 and twin in c["derivation"]
        assert checks[("token_accounting", name)]["passed"]
    assert "refusing to resume" in runs["refuse_batch"]["failure"]
    disagree = runs["disagree"]["failure"]
    assert "rank 0: step-00000008" in disagree and "rank 1: step-00000004" in disagree
    lines = runs["not_visible"]["failure"].splitlines()
    assert lines[0].startswith("rank 1 failed while resuming from a checkpoint")
    assert lines[1].startswith("rank 0: a peer rank failed: rank 1 failed while resuming")


def _learns(run: dict) -> None:
    assert run["losses"][-1] < 0.85 * run["losses"][0]  # captions describe the images: the loss falls


def vlm_parity(runs: dict, checks: dict, out: Path) -> None:
    for name in ("single", "ddp2", "ddp4"):
        r = runs[name]
        _learns(r)
        assert r["images_global"] == 16 * 8 and r["median_img_s"] > 0 and r["vision"]["arch"] == "qwen2_vl"
        assert r["vision"]["image_token_counts"] == [4]  # 56 x 56: a 4 x 4 patch grid merged 2 x 2
    for name in ("ddp2", "ddp4"):
        for check in ("loss_parity", "param_parity", "eval_parity", "replica_consistency", "memory_rss_per_rank_mb",
                      "memory_mlx_total_mb"):
            assert checks[(check, name)]["result"] == "pass", check
    # 13 eval rows over 4 ranks: 4/3/3/3, the short ranks pad with a row of no image and no target
    assert [d["eval_pad_rows_local"] for d in runs["ddp4"]["data"]] == [0, 1, 1, 1]
    assert "Post-step-1 median img/s" in (out / "report.md").read_text()


def vlm_local_rows(runs: dict, checks: dict, out: Path) -> None:
    counts = runs["single"]["vision"]["image_token_counts"]
    assert len(counts) > 1  # images of different sizes: different patch grids in the same batches
    assert checks[("eval_parity", "ddp2")]["passed"] and checks[("loss_parity", "ddp2")]["value"] <= 1e-5
    _learns(runs["single"])


def vlm_local_chat(runs: dict, checks: dict, out: Path) -> None:
    assert checks[("loss_parity", "ddp2")]["value"] <= 1e-5 and runs["single"]["tokens_global"] > 0
    _learns(runs["single"])


def vlm_compile(runs: dict, checks: dict, out: Path) -> None:
    for name in ("best_effort1", "best_effort2"):
        assert checks[("compile_scope", name)]["value"] == "fallback-eager"
        reason = runs[name]["compile"]["fallback_reason"]
        assert reason.startswith("rank 0 failed while compiling the local step at step 1: ValueError: [eval]"), reason
    assert checks[("loss_parity", "best_effort2")]["value"] == 0.0  # eager after the fallback: same bits
    failure = runs["strict2"]["failure"].splitlines()
    assert [line.split(" failed while compiling")[0] for line in failure] == ["rank 0", "rank 1"], failure
    assert checks[("expected_failure", "strict2")]["detail"].endswith("on 2 of 2 ranks")


def vlm_batch_variant(runs: dict, checks: dict, out: Path) -> None:
    for name in ("step_loss_parity", "step_grad_parity"):  # at identical parameters: the split shows
        c = checks[(name, "ddp2")]
        assert c["result"] == "xfail" and c["value"] > 10 * c["limit"] and "expected to fail" in c["detail"]
    for name in ("loss_parity", "param_parity"):  # the twin splits the batch too: refused as a floor
        c = checks[(name, "ddp2")]
        assert c["result"] == "xfail" and c["value"] > 0.01 and "floor refused: twin2" in c["detail"]
    assert checks[("replica_consistency", "ddp2")]["result"] == "pass"
    assert checks[("token_accounting", "ddp2")]["result"] == "pass"


def vlm_stream_resume(runs: dict, checks: dict, out: Path) -> None:
    for resumed, full in (("resumed1", "materialized"), ("resumed2", "full2"), ("stream2_resumed", "stream2")):
        _bitwise_resume(runs, checks, resumed, full, 6)
        assert runs[resumed]["images_global"] == runs[full]["images_global"] == 12 * 8
    whole = runs["materialized"]["data"][0]["bytes_held"]
    for name in ("stream2", "stream4"):
        assert checks[("loss_parity", name)]["value"] <= 1e-5
        assert all(d["streaming"] and d["bytes_held"] < whole / 2 for d in runs[name]["data"])


def prose_parity(runs: dict, checks: dict, out: Path) -> None:
    single = runs["single"]
    assert single["losses"][-1] < single["losses"][0] - 0.3  # real text, a trained BPE: the model learns
    for name in ("ddp2", "ddp4"):
        for check in ("step_token_parity", "step_loss_parity", "step_grad_parity", "loss_parity", "param_parity",
                      "eval_parity"):
            assert checks[(check, name)]["result"] == "pass", check
        assert [p["step"] for p in runs[name]["probes"][0]] == [1, 3, 6, 9]
        # ranks hold very different token counts on real prose
        tokens = [r["tokens_local"] for r in runs[name]["ranks"]]
        assert max(tokens) > 1.05 * min(tokens)


def mutations(runs: dict, checks: dict, out: Path) -> None:
    from harness.trainers.reference.semantics import MUTATIONS

    mutated = {r["mutation"]: r["name"] for r in runs.values() if r.get("mutation")}
    assert set(mutated) == set(MUTATIONS)  # every bug of the list is tried
    for run in mutated.values():
        caught = checks[("mutation_caught", run)]
        assert caught["passed"] and (caught["value"] is None or caught["value"] >= 10), caught
        assert any(c["result"] == "caught" for (_, r), c in checks.items() if r == run)
        # caught by a check with a finite margin of 10 or more (not only by an exact criterion)
        finite = [c["margin"] for (_, r), c in checks.items() if r == run and c.get("margin") is not None
                  and c["name"] != "mutation_caught"]
        assert finite and max(finite) >= 10, run
    assert all(c["result"] == "pass" for (_, r), c in checks.items() if r == "correct")
    named = {"mean_of_means": "mean_of_means", "sum_not_average": "grad_times_world", "same_shard": "same_rows",
             "drop_uneven": "other_rows"}  # the reduction right, the rows not: the dropped micro-batch
    for bug, defect in named.items():
        grad = checks[("step_grad_parity", mutated[bug])]
        assert grad["defect"] == defect, (bug, grad["detail"])
    seeds = checks[("start_parity", mutated["rank_seeds"])]  # the defect named where the ranks start apart
    assert seeds["defect"] == "rank_seeds" and "matches: ranks seeded differently" in seeds["detail"], seeds
    report = (out / "report.md").read_text()
    assert "### Injected DDP bugs" in report and "| stale_gradient " in report


def guide_throughput(runs: dict, checks: dict, out: Path) -> None:
    single, ddp2 = runs["single"], runs["ddp2"]
    assert (single["global_batch"], ddp2["global_batch"]) == (4, 8)
    assert single["per_rank_batch"] == ddp2["per_rank_batch"] == "1 x 4 accum"
    assert 1.8 < ddp2["tokens_global"] / single["tokens_global"] < 2.2  # twice the rows per step
    assert not {name for name, _ in checks} & {"loss_parity", "param_parity", "eval_parity"}  # not a parity test
    for name in ("replica_consistency", "token_accounting", "data_share_bytes", "memory_rss_per_rank_mb"):
        assert checks[(name, "ddp2")]["result"] == "pass"
    doc = json.loads((out / "result.json").read_text())
    table = runs_table(doc["scenarios"][0])
    speed = ddp2["median_tok_s"] / single["median_tok_s"]
    assert f"{speed:.2f}x" in table and "1.00x" in table and "Effective global batch" in table


STEP_LOCAL = ("step_token_parity", "step_loss_parity", "step_grad_parity")


def _external(runs: dict, checks: dict, compared: tuple[str, ...], kind: str, ref: str = "single") -> None:
    """An external trainer's scenario: its runs report the trainer, the step-local checks are
    measured through the trainer's own code where it has a seam (n/a, never passed, where not),
    the floor is the split runs of the compared run's world size (three draws of the rounding,
    the largest deviation judged), and replicas and ranks agree."""
    for name in compared:
        n = max(runs[name]["world_size"], 2)
        draws = [f"{ref}_split{n}", f"{ref}_split{n}_s2", f"{ref}_split{n}_s3"]
        for k, draw in enumerate(draws):
            assert runs[draw]["floor"].endswith(f"each batch in {n} row chunks as ranks hold them; "
                                                f"rounding draw {k + 1} of 3"), runs[draw]["floor"]
        assert f"the largest of {', '.join(draws)}'s" in checks[("loss_parity", name)]["derivation"]
        assert runs[name]["trainer"] == kind
        streaming = runs[name]["data"][0]["streaming"]  # a stream holds no share to judge
        probed = trainer_info(kind).probes  # through the trainer's own loss and reduction
        for check in (() if probed else STEP_LOCAL) + (() if streaming else ("data_share_bytes",)):
            c = checks[(check, name)]
            assert c["result"] == "n/a" and c["detail"].startswith("not applicable: "), c
        for check in STEP_LOCAL[1:] if probed else ():  # a stream's batches cannot be read ahead: n/a
            c = checks[(check, name)]
            assert (c["result"] == "n/a") == streaming and (streaming or c["power"] == c["limit"]), c
            precision = runs[name]["ranks"][0]["precision"]  # probes of a narrower dtype compute in float32
            label = precision["label"] if "probe" not in precision else \
                f"{precision['probe']['label']} (probes; training {precision['label']})"
            assert streaming or c["precision"] == label, c
        for check in ("replica_consistency", "ranks_agree", "token_accounting", "rank0_side_effects", "lr_schedule"):
            assert checks[(check, name)]["result"] == "pass", check
    for r in runs.values():
        assert r["ranks"][0]["status"] == "ok"


def mlx_lm_parity(runs: dict, checks: dict, out: Path) -> None:
    _external(runs, checks, ("ddp2", "ddp4"), "mlx_lm")
    for name in ("ddp2", "ddp4"):
        for check in (*STEP_LOCAL, "loss_parity", "param_parity", "eval_parity"):
            assert checks[(check, name)]["result"] == "pass"
        assert [e["step"] for e in runs[name]["evals"]] == [0, 5, 11]  # mlx-lm evaluates before the step
        assert runs[name]["side_effects"][0] == {"saves": 1} and runs[name]["side_effects"][1] == {"saves": 0}
    assert checks[("global_rng_untouched", "ddp2")]["result"] == "n/a"
    single = runs["single"]
    assert single["losses"][-1] < single["losses"][0] - 0.3  # mlx-lm really trained the model


def mlx_lm_lora(runs: dict, checks: dict, out: Path) -> None:
    _external(runs, checks, ("ddp2",), "mlx_lm")
    for check in (*STEP_LOCAL, "loss_parity"):
        assert checks[(check, "ddp2")]["result"] == "pass", check
    param = checks[("param_parity", "ddp2")]  # the adapters, by the update they make (lora_a @ lora_b)
    assert ".lora_a @ lora_b" in param["detail"], param
    # with power where this CPU's rounding allows it; else INCONCLUSIVE, saying so (MAY_NOT_DECIDE), never FAIL
    assert (param["result"], param["no_power"]) in (("pass", False), ("INCONCLUSIVE", True)), param
    assert runs["single"]["param_count"] < 30_000  # the trainable (LoRA) parameters only


def mlx_lm_mean_of_means(runs: dict, checks: dict, out: Path) -> None:
    _external(runs, checks, ("ddp2",), "mlx_lm")
    _external_xfail(runs, checks)
    grad = checks[("step_grad_parity", "ddp2")]  # at single's parameters: the objective itself differs
    assert grad["result"] == "xfail" and grad["value"] > 10 * grad["limit"], grad
    for check in ("step_loss_parity", "step_grad_parity"):  # and the defect is named
        c = checks[(check, "ddp2")]
        assert c["defect"] == "mean_of_means" and "matches: the mean of the ranks' per-rank mean" in c["detail"], c
    assert checks[("step_token_parity", "ddp2")]["result"] == "pass"
    assert checks[("token_accounting", "ddp2")]["result"] == "pass"  # the same rows, another objective


def mlx_lm_resume(runs: dict, checks: dict, out: Path) -> None:
    """mlx-lm resumes from its step-6 adapter file: with AdamW on 6 batches it departs from the
    uninterrupted run (expected failures); with stateless SGD on one batch it matches bitwise."""
    for name in ("resumed2", "sgd_resumed2"):
        r = runs[name]
        assert r["trainer"] == "mlx_lm" and r["resume"]["identity"].startswith("0000006_adapters.safetensors (")
        assert r["history_start"] == 7 and r["steps"] == 10 and len(r["losses"]) == 4
        for check in ("resume_step", "replica_consistency", "ranks_agree", "rank0_side_effects", "token_accounting"):
            assert checks[(check, name)]["result"] == "pass", (check, name)
    for check in ("resume_loss_parity", "resume_param_parity", "resume_eval_parity"):
        assert checks[(check, "sgd_resumed2")]["result"] == "pass" and checks[(check, "sgd_resumed2")]["value"] == 0
        c = checks[(check, "resumed2")]
        assert c["result"] == "xfail" and c["limit"] == 0 and c["value"] > 1e-4, c  # the rerun of full2 is bitwise
    assert runs["sgd_resumed2"]["losses"] == runs["sgd_full2"]["losses"][6:]
    assert checks[("resume_accounting", "sgd_resumed2")]["result"] == "pass"
    accounting = checks[("resume_accounting", "resumed2")]
    assert accounting["result"] == "xfail" and "tokens_global_per_step differs" in accounting["detail"]


def mlx_vlm_parity(runs: dict, checks: dict, out: Path) -> None:
    _external(runs, checks, ("ddp2", "ddp4"), "mlx_vlm")
    for name in ("ddp2", "ddp4"):
        for check in ("loss_parity", "param_parity", "eval_parity"):
            assert checks[(check, name)]["result"] == "pass"
        assert [e["step"] for e in runs[name]["evals"]] == [6, 12]  # mlx-vlm evaluates after the step
        assert runs[name]["side_effects"][0] == {"saves": 1} and runs[name]["side_effects"][1] == {"saves": 0}
        agree = checks[("ranks_agree", name)]["detail"]
        assert "rank 0's (mlx-vlm calls its training callback on rank 0 only)" in agree
        tokens = [r["tokens_local"] for r in runs[name]["ranks"]]
        assert len(set(tokens)) == 1  # answers of one length: every rank supervises as many tokens
    assert checks[("global_rng_untouched", "ddp2")]["result"] == "n/a"
    assert runs["single"]["losses"][-1] < runs["single"]["losses"][0] - 1.0  # mlx-vlm really trained


def mlx_vlm_mean_of_means(runs: dict, checks: dict, out: Path) -> None:
    _external(runs, checks, ("ddp2",), "mlx_vlm")
    _external_xfail(runs, checks)
    grad = checks[("step_grad_parity", "ddp2")]  # its gradient's defect named (its reported loss is token-weighted)
    assert grad["result"] == "xfail" and grad["defect"] == "mean_of_means", grad
    assert grad["value"] >= 10 * grad["limit"], grad  # at the reference's parameters, far beyond rounding
    for check in ("step_token_parity", "step_loss_parity"):
        assert checks[(check, "ddp2")]["result"] == "pass", checks[(check, "ddp2")]
    _probed_from_step_1(runs)
    assert checks[("token_accounting", "ddp2")]["result"] == "pass"  # the same rows, another objective
    single, ddp2 = runs["single"]["losses"], runs["ddp2"]["losses"]
    assert abs(single[0] - ddp2[0]) < 1e-5 * single[0]  # at step 1 the reported (token-weighted) loss agrees
    assert len({r["tokens_local"] for r in runs["ddp2"]["ranks"]}) == 2  # captions of different lengths


def unsloth_parity(runs: dict, checks: dict, out: Path) -> None:
    _external(runs, checks, ("ddp2", "ddp4"), "unsloth_zoo")
    for name in ("ddp2", "ddp4"):
        for check in ("loss_parity", "param_parity", "eval_parity", "global_rng_untouched"):
            assert checks[(check, name)]["result"] == "pass"
        assert [e["step"] for e in runs[name]["evals"]] == [6, 12]
        assert runs[name]["side_effects"][0]["saves"] >= 1 and runs[name]["side_effects"][1] == {"saves": 0}
        tokens = [r["tokens_local"] for r in runs[name]["ranks"]]
        assert len(set(tokens)) > 1  # response-only rows of varying length: token weighting is exercised
    assert runs["single"]["losses"][-1] < runs["single"]["losses"][0] - 1.0  # unsloth-zoo really trained


def unsloth_compiled(runs: dict, checks: dict, out: Path) -> None:
    _external(runs, checks, ("ddp2",), "unsloth_zoo")
    assert {n: checks[("compile_scope", n)]["value"] for n in ("single", "ddp2")} == \
        {"single": "full-step", "ddp2": "local-grad"}
    assert checks[("param_parity", "ddp2")]["result"] == "pass"


def unsloth_streaming(runs: dict, checks: dict, out: Path) -> None:
    _external(runs, checks, ("stream2", "stream4"), "unsloth_zoo", ref="in_memory")
    assert runs["in_memory"]["data"] == [{"streaming": False, "bytes_held": 150768}]
    for name in ("stream1", "stream2", "stream4"):
        for check in ("loss_parity", "param_parity", "eval_parity", "token_accounting"):
            assert checks[(check, name)]["result"] == "pass", (check, name)
        # 12 steps of 8 rows: the 64-row stream once and half again, read lazily by rank 0 alone
        # (unsloth-zoo sends each rank its rows); no rank holds the dataset
        first, *others = runs[name]["data"]
        assert first == {"streaming": True, "rows_read": 96, "bytes_held": None}
        assert [d["rows_read"] for d in others] == [0] * (runs[name]["world_size"] - 1)
        assert [e["step"] for e in runs[name]["evals"]] == [6, 12]
    assert checks[("loss_parity", "stream1")]["value"] == 0  # one process, the same batches: the same bits
    assert checks[("param_parity", "stream1")]["value"] == 0


def _unsloth_known(runs: dict, checks: dict) -> None:
    _external_xfail(runs, checks)
    assert checks[("token_accounting", "single")]["result"] == "pass"
    assert checks[("token_accounting", "ddp2")]["result"] == "xfail"


def _probed_from_step_1(runs: dict) -> None:
    """The reference recorded its probe steps from step 1, and every rank of ddp2 probed the same."""
    steps = [p["step"] for p in runs["single"]["probes"][0]]
    assert steps[0] == 1 and len(steps) >= 2, steps
    assert [[p["step"] for p in rank] for rank in runs["ddp2"]["probes"]] == [steps, steps]


def _external_xfail(runs: dict, checks: dict) -> None:
    for check in ("loss_parity", "param_parity", "eval_parity"):
        c = checks[(check, "ddp2")]
        assert c["result"] == "xfail" and c["value"] > 10 * c["limit"], c
    for check in ("replica_consistency", "ranks_agree", "rank0_side_effects"):
        assert checks[(check, "ddp2")]["result"] == "pass", check


def unsloth_tail_padding(runs: dict, checks: dict, out: Path) -> None:
    _unsloth_known(runs, checks)
    for check in ("step_loss_parity", "step_grad_parity"):  # the reduction is right, the rows are not
        c = checks[(check, "ddp2")]
        assert c["defect"] == "other_rows" and "the rows each rank reads differ" in c["detail"], c
    single, ddp2 = runs["single"]["tokens_global_per_step"], runs["ddp2"]["tokens_global_per_step"]
    assert single[:5] == ddp2[:5] and single[5] < ddp2[5]  # the short 6th batch, padded under DDP


def unsloth_default_order(runs: dict, checks: dict, out: Path) -> None:
    _unsloth_known(runs, checks)
    for check in ("step_loss_parity", "step_grad_parity"):
        c = checks[(check, "ddp2")]
        assert c["defect"] == "same_rows" and "matches: every rank on the same rows" in c["detail"], c
        assert c["result"] == "xfail" and c["value"] >= 10 * c["limit"], c  # at the reference's parameters
    tokens = checks[("step_token_parity", "ddp2")]
    assert tokens["result"] == "xfail" and tokens["value"] > 0, tokens  # other tokens counted from step 1
    assert runs["single"]["losses"][0] != runs["ddp2"]["losses"][0]  # other rows from the first step
    _probed_from_step_1(runs)


def unsloth_seed_table(runs: dict, checks: dict, out: Path) -> None:
    _external(runs, checks, ("ddp2",), "unsloth_zoo")
    assert checks[("loss_parity", "ddp2")]["result"] == "pass"
    assert checks[("global_rng_untouched", "ddp2")]["result"] == "n/a"  # LoRA: mlx-lm seeds MLX's RNG
    # the bfloat16 LoRA adapters, by the update they make: their factors moved 1.4 % in 8 steps, where the
    # absolute floor of bfloat16 storage once set the limit (0.31); the update moved all of its length
    param = checks[("param_parity", "ddp2")]
    assert param["result"] == "pass" and ".lora_a @ lora_b" in param["detail"] and param["limit"] <= 0.5, param
    assert runs["ddp2"]["compile"]["scope"] == "local-grad"


def trainer_throughput(runs: dict, checks: dict, out: Path) -> None:
    """Three trainers timed on the same model, rows, batch and world sizes, side by side."""
    for kind in ("reference", "mlx_lm", "unsloth_zoo"):
        for n in (1, 2):
            r = runs[f"{kind}_{n}"]
            assert r["trainer"] == kind and r["world_size"] == n and r["global_batch"] == 8
            assert r["median_tok_s"] > 0 and r["steps"] == 24
    report = (out / "report.md").read_text()
    assert "Throughput vs reference_2" in report and "| mlx_lm_2 " in report and "| unsloth_zoo_2 " in report


def script_example(runs: dict, checks: dict, out: Path) -> None:
    _external(runs, checks, ("ddp2", "ddp4"), "script")
    for name in ("ddp2", "ddp4"):
        for check in ("loss_parity", "param_parity", "global_rng_untouched"):
            assert checks[(check, name)]["result"] == "pass"
        tokens = [r["tokens_local"] for r in runs[name]["ranks"]]
        assert len(set(tokens)) > 1  # completion-only loss: the ranks hold different token counts
        assert checks[("rank0_side_effects", name)]["detail"] == ("rank 0: saves 1; other ranks: none; a save "
                                                                  "on rank 0 demanded: the script declares [trainer] "
                                                                  "saves = true")


def _bf16(runs: dict, checks: dict, compared: tuple[str, ...]) -> None:
    """A scenario in bfloat16: every rank computed in it (its limits follow), the step-local probes
    in float32, and each trajectory check passed with power (a limit at most half of what training
    moved: INCONCLUSIVE otherwise)."""
    for name in compared:
        assert all(r["precision"]["dtype"] == "bfloat16" for r in (runs[name]["ranks"])), runs[name]["ranks"]
        for check in ("step_loss_parity", "step_grad_parity"):
            c = checks[(check, name)]
            assert c["result"] == "pass" and c["precision"] == "float32 (probes; training bfloat16)", c
            assert c["limit"] < 1e-5  # float32's rounding: a mean of means (0.13) is 10^4 limits away
        for check in ("loss_parity", "param_parity"):
            c = checks[(check, name)]
            assert c["result"] == "pass" and c["precision"] == "bfloat16" and not c["no_power"], c


def bf16_parity(runs: dict, checks: dict, out: Path) -> None:
    _bf16(runs, checks, ("ddp2",))
    assert checks[("eval_parity", "ddp2")]["result"] == "pass"


def script_bf16(runs: dict, checks: dict, out: Path) -> None:
    _external(runs, checks, ("ddp2",), "script")
    _bf16(runs, checks, ("ddp2",))


SPECIFIC: dict[str, Callable[[dict, dict, Path], None]] = {
    f.__name__: f for f in (compile_modes, failure_consensus, early_stop, streaming, response_only, grad_accum,
                            chat_jsonl, resume_parity, resume_after_kill, resume_validation, vlm_parity,
                            vlm_local_rows, vlm_local_chat, vlm_compile, vlm_batch_variant, vlm_stream_resume,
                            guide_throughput, prose_parity, mutations, mlx_lm_parity, mlx_lm_lora,
                            mlx_lm_mean_of_means, mlx_lm_resume, mlx_vlm_parity, mlx_vlm_mean_of_means, unsloth_parity,
                            unsloth_compiled, unsloth_tail_padding, unsloth_default_order, unsloth_seed_table,
                            unsloth_streaming, trainer_throughput, script_example, memory_runaway, speed_gate,
                            bf16_parity, script_bf16)
}


def test_every_shipped_scenario_has_a_test() -> None:
    shipped = {p.stem for p in (REPO / "scenarios").glob("*.toml")}
    # text_parity: tests/test_cli.py; link_down (across hosts, a link taken down): tests/test_cluster.py
    assert shipped == set(SPECIFIC) | {"text_parity", "link_down"}


def _in_its_set(name: str) -> Any:
    """A scenario of the default set is a test of every session; one only in the full set (``run
    --all``) is a test of the full set of tests (``pytest --all``)."""
    from harness.scenario import load_scenario

    default = load_scenario(REPO / "scenarios" / f"{name}.toml").default
    return pytest.param(name, marks=() if default else pytest.mark.full)


@pytest.mark.parametrize("name", [_in_its_set(n) for n in sorted(SPECIFIC)])
def test_shipped_scenario(name: str, tmp_path: Path, shared_run: SharedRun, request: pytest.FixtureRequest) -> None:
    if name.startswith("unsloth_") or name == "trainer_throughput":
        needs_unsloth()
    s, runs, checks = _run(name, tmp_path, shared_run, full_set(request.config))
    for r in runs.values():
        for e in r.get("evals") or []:
            assert math.isfinite(e["loss"])
    SPECIFIC[name](runs, checks, tmp_path)


def test_each_power_scenario_plans_its_shipped_scenarios_runs_alike() -> None:
    """So that one run of each answers both tests (``shared_with_power``)."""
    for path in sorted(POWER.glob("*.toml")):
        assert shared_with_power(path.stem), path.name
