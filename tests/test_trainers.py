"""Trainers under test (``[trainer] kind``): real ranks under mlx.launch, through the CLI.

The shipped adapter scenarios run in tests/test_scenarios.py; here: a user's script with real DDP
bugs is caught, a script is held to the saves it declares, a broken trainer (raises, hangs, exits
without a result) fails with one line naming it (exit 3), settings a trainer cannot honour are
bad input, and mlx-lm resumes from kept adapter files (a missing or damaged one is bad input).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import EXAMPLE, REPO, cli, needs_unsloth, script_scenario


@pytest.mark.ranks
def test_a_script_with_ddp_bugs_is_caught(tmp_path: Path) -> None:
    """The example with two real bugs: each rank's gradient of its own mean loss (the mean of
    per-rank means) and a save on every rank. Step-local parity (through the script's
    ``run.probe``), the trajectories and the rank-0 check fail; exit 1."""
    src = EXAMPLE.read_text()
    buggy = src.replace("scaled(grads, size / tokens)", "scaled(grads, 1 / mask.sum())")
    buggy = buggy.replace("if rank == 0:  # save once, on rank 0", "if True:")
    assert buggy.count("1 / mask.sum()") == 1 and "if True:" in buggy
    path = script_scenario(tmp_path, buggy)
    p = cli("run", str(path), "--out", str(tmp_path / "o"))
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    checks = {(c["name"], c["run"]): c for c in json.loads((tmp_path / "o" / "result.json").read_text())
              ["scenarios"][0]["checks"]}
    assert checks[("param_parity", "ddp2")]["result"] == "FAIL"
    assert checks[("param_parity", "ddp2")]["value"] > 10 * checks[("param_parity", "ddp2")]["limit"]
    assert checks[("rank0_side_effects", "ddp2")]["result"] == "FAIL"
    assert checks[("rank0_side_effects", "single")]["result"] == "pass"
    grad = checks[("step_grad_parity", "ddp2")]  # the script's own step, at single's parameters
    assert grad["result"] == "FAIL" and grad["value"] > 10 * grad["limit"], grad
    assert checks[("step_token_parity", "ddp2")]["result"] == "pass"


SAVE_EVERYWHERE = ('    mx.save_safetensors(str(run.run_dir / f"model{rank}.safetensors"),\n'
                   "                        dict(tree_flatten(model.parameters())))\n"
                   "    run.saved()\n")


def example_saving(save: str) -> str:
    """The example script with its rank-0 save (up to ``run.finish``) replaced by ``save``."""
    head, rest = EXAMPLE.read_text().split("    if rank == 0:  # save once, on rank 0\n")
    return head + save + rest[rest.index("    run.finish("):]


def run_checks(path: Path, out: Path, rc: int) -> dict[tuple[str, str], dict[str, Any]]:
    p = cli("run", str(path), "--out", str(out))
    assert p.returncode == rc, p.stdout[-3000:] + p.stderr[-2000:]
    return {(c["name"], c["run"]): c for c in json.loads((out / "result.json").read_text())["scenarios"][0]["checks"]}


@pytest.mark.ranks
def test_a_correct_script_that_saves_nothing_passes(tmp_path: Path) -> None:
    """A save on rank 0 is demanded only where the script declares one: a correct script that
    saves nothing passes every check, at 1 and 2 ranks."""
    checks = run_checks(script_scenario(tmp_path, example_saving("")), tmp_path / "o", 0)
    assert {c["result"] for c in checks.values()} <= {"pass", "n/a"}
    for name in ("single", "ddp2"):
        c = checks[("rank0_side_effects", name)]
        assert c["result"] == "pass" and c["detail"].endswith(
            "; other ranks: none; a save on rank 0 not demanded: the script does not declare [trainer] saves"), c


@pytest.mark.ranks
@pytest.mark.parametrize(("save", "declared", "detail"), [
    (SAVE_EVERYWHERE, False, "rank 0: saves 1; other ranks: rank 1: saves 1; a save on rank 0 not "
                             "demanded: the script does not declare [trainer] saves"),
    ("", True, "rank 0: saves 0; other ranks: none; a save on rank 0 demanded: the script declares [trainer] "
               "saves = true"),
], ids=["saves-on-every-rank", "declared-save-missing"])
def test_a_script_breaking_its_save_promise_fails(tmp_path: Path, save: str, declared: bool, detail: str) -> None:
    """A save on rank 1 fails the check, and so does a missing save the script declared; every
    other check passes."""
    path = script_scenario(tmp_path, example_saving(save), world_sizes=(2,))
    if declared:
        path.write_text(path.read_text().replace('path = "script.py"\n', 'path = "script.py"\nsaves = true\n'))
    checks = run_checks(path, tmp_path / "o", 1)
    assert [k for k, c in checks.items() if c["result"] not in ("pass", "n/a")] == [("rank0_side_effects", "ddp2")]
    assert checks[("rank0_side_effects", "ddp2")]["detail"] == detail


HEAD = "from harness import api\nrun = api.session()\n"


@pytest.mark.ranks
@pytest.mark.parametrize(("script", "line"), [
    (HEAD + "raise RuntimeError('boom')\n", "trainer script broken.py raised RuntimeError: boom"),
    (HEAD + "import sys\nsys.exit(4)\n", "trainer script broken.py exited with status 4"),
    (HEAD + "import sys\nsys.exit('no data')\n", "trainer script broken.py exited with status 1: no data"),
    (HEAD + "pass\n", "trainer script broken.py reported no steps"),
    (HEAD + "run.step(1, 1.0, 10, 5)\n", "trainer script broken.py never handed over its final parameters"),
    (HEAD + "run.step(1, 1.0, 10, 5)\nrun.finish({'w': 1.0})\n",
     "trainer script broken.py raised TypeError: run.finish(params): w is not an MLX array (pass model.parameters())"),
    (HEAD + "import time\nrun.step(1, 1.0, 10, 5)\ntime.sleep(600)\n",
     "trainer script: watchdog: no progress from any rank for 4 s"),
], ids=["raises", "exits", "exits-saying-why", "reports-nothing", "no-params", "not-params", "hangs"])
def test_a_broken_script_fails_with_one_line_naming_it(tmp_path: Path, script: str, line: str) -> None:
    hangs = "sleep(600)" in script  # the watchdog's wait only matters where the script hangs
    path = script_scenario(tmp_path, script, name="broken", world_sizes=(2,), no_progress_s=4 if hangs else 60)
    p = cli("run", str(path), "--out", str(tmp_path / "o"))
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-2000:]
    assert line in p.stdout, p.stdout[-3000:]
    assert "survived" not in p.stdout  # the process group is gone
    doc = json.loads((tmp_path / "o" / "result.json").read_text())
    assert doc["exit_code"] == 3 and doc["scenarios"][0]["status"] == "error"


def run_faulted(tmp_path: Path, scenario: str, action: str = "raise") -> str:
    """The shipped scenario's 2-rank run alone for 4 steps (no reference, so no floor runs either),
    rank 1 doing ``action`` at step 2: exit 3, no stray process; returns the printed output. The
    watchdog waits 8 s for progress where rank 1 hangs, 60 s otherwise (a first step on a loaded
    machine can take 8 s)."""
    body = (REPO / "scenarios" / f"{scenario}.toml").read_text()
    for part in ('[[runs]]\nname = "ddp4"\nworld_size = 4\n', '[[runs]]\nname = "single"\nworld_size = 1\n',
                 'reference = "single"\n', "steps = 12"):
        assert part in body, part
        body = body.replace(part, "steps = 4" if part == "steps = 12" else "")
    body += f'\n[[faults]]\nrank = 1\nstep = 2\naction = "{action}"\nruns = ["ddp2"]\n'
    body += f"\n[limits]\nno_progress_s = {8 if action == 'hang' else 60}\n" if "[limits]" not in body else ""
    body = body.replace('"data/', f'"{REPO}/scenarios/data/')  # the scenario's own data, from elsewhere
    path = tmp_path / f"{scenario}_fault.toml"
    path.write_text(body)
    p = cli("run", str(path), "--out", str(tmp_path / "o"))
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-2000:]
    assert "survived" not in p.stdout
    return p.stdout


@pytest.mark.ranks
def test_a_failing_mlx_lm_trainer_is_named(tmp_path: Path) -> None:
    out = run_faulted(tmp_path, "mlx_lm_parity")
    assert ("rank 1 failed: trainer mlx_lm (mlx_lm.tuner.trainer.train) raised RuntimeError: injected fault in "
            "phase step at step 2") in out


@pytest.mark.ranks
@pytest.mark.parametrize(("action", "line"), [
    ("hang", "trainer mlx_lm: watchdog: no progress from any rank for 8 s"),
    ("exit0", "run ddp2 (world size 2): rank 1 exited with exit code 0 without writing a result"),
])
def test_a_hanging_or_vanishing_mlx_lm_trainer_is_named(tmp_path: Path, action: str, line: str) -> None:
    """Rank 1 hangs, or exits 0 without a result, inside mlx-lm's loop (from its callback); rank 0,
    left alone in an all-reduce, is stopped too (by the lost connection or the watchdog)."""
    out = run_faulted(tmp_path, "mlx_lm_parity", action)
    assert line in out and "mlx_lm_parity: ERROR" in out, out[-3000:]
    if action == "exit0":
        assert "rank 0: trainer mlx_lm" in out or "watchdog" in out


@pytest.mark.ranks
def test_a_failing_unsloth_trainer_is_named(tmp_path: Path) -> None:
    """A rank that raises inside unsloth-zoo's loop (from its callback, on rank 1 only) goes
    through unsloth-zoo's own failure consensus: every rank stops, the cause names the trainer."""
    needs_unsloth()
    out = run_faulted(tmp_path, "unsloth_parity")
    line = next(x for x in out.splitlines() if x.startswith("rank 1 failed: "))
    assert line.startswith("rank 1 failed: trainer unsloth_zoo (unsloth_zoo.mlx.trainer.MLXTrainer) raised ")
    assert "injected fault in phase step at step 2" in line
    assert "rank 0 failed: trainer unsloth_zoo" in out  # the peer stopped too, not hung


@pytest.mark.ranks
def test_a_failing_mlx_vlm_trainer_is_named(tmp_path: Path) -> None:
    """mlx-vlm has no failure consensus: rank 1 raises inside its loop, rank 0 waits in the next
    all-reduce until the watchdog stops it; the cause names the trainer, nothing is left behind."""
    out = run_faulted(tmp_path, "mlx_vlm_parity")
    assert ("rank 1 failed: trainer mlx_vlm (mlx_vlm.trainer.Trainer) raised RuntimeError: injected fault in "
            "phase step at step 2") in out


@pytest.mark.ranks
def test_unsloth_streaming_pads_a_short_last_batch_under_ddp_and_is_caught(mlx_ddp: Any) -> None:
    """unsloth_streaming with 45 rows (5 global batches of 8 and one of 5) against one streaming
    process: under DDP unsloth-zoo's stream pads the short batch with the epoch's first rows, so
    from step 6 the 2 ranks train on more tokens; the parity checks fail on it. The floor run
    streams too (each batch's rows reversed, read lazily). Run through the harness's own pytest
    fixture (``mlx_ddp``), as a user's test would."""
    needs_unsloth()
    body = (REPO / "scenarios" / "unsloth_streaming.toml").read_text()
    body = body.replace("rows = 64 ", "rows = 45 ").replace('reference = "in_memory"', 'reference = "stream1"')
    body = body.replace('[[runs]]\nname = "in_memory"\nworld_size = 1\n', "")
    body = body.replace('[[runs]]\nname = "stream4"\nworld_size = 4\ndata = { streaming = true }\n', "")
    result = mlx_ddp(body)
    assert result.status == "failed", result.table
    assert set(result.runs) == {"stream1", "stream2", "stream1_split2", "stream1_split2_s2", "stream1_split2_s3"}
    failed = {(c.name, c.run) for c in result.checks if not c.passed}
    assert failed == {("loss_parity", "stream2"), ("param_parity", "stream2"), ("eval_parity", "stream2"),
                      ("token_accounting", "stream2")}, failed
    one, two = (result.runs[r].result["tokens_global_per_step"] for r in ("stream1", "stream2"))
    assert one[:5] == two[:5] and one[5] < two[5]  # the short 6th batch, padded under DDP
    floor = next(r for r in result.summary["runs"] if r["name"] == "stream1_split2")
    assert floor["data"][0]["streaming"] and floor["data"][0]["rows_read"] > 45
    loss = result.check("loss_parity", "stream2")
    assert loss.value > 10 * loss.limit and "stream1_split2_s3's" in loss.derivation


UNSLOTH = 'kind = "unsloth_zoo"'


@pytest.mark.parametrize(("trainer", "extra", "needle"), [
    ('kind = "mlx_lm"', "[train]\nmax_grad_norm = 1.0\n", "[[runs]][0].train.max_grad_norm: mlx-lm's trainer does "
                                                          "not clip gradients"),
    ('kind = "script"', "", "[trainer].path: a 'script' trainer needs the path of a Python training script"),
    ('kind = "script"\npath = "nowhere.py"', "", "[trainer].path: path does not exist"),
    ('kind = "mlx_vlm2"', "", "[trainer].kind: must be one of"),
    ('kind = "script"\npath = "t.py"\nsaves = "yes"', "", "[trainer].saves: expected bool | None, got 'yes'"),
    ('kind = "mlx_lm"\nsaves = false', "", "[trainer].saves: only a 'script' trainer declares its saves"),
    ('kind = "reference"\nfine_tune = "lora"', "", "[trainer].fine_tune: LoRA is an option of the 'mlx_lm', "
                                                    "'mlx_vlm', 'unsloth_zoo', 'script' trainers"),
    ('kind = "mlx_vlm"', "", "[model].arch: the mlx_vlm trainer trains vision-language models (qwen2_vl, paligemma)"),
    ('kind = "mlx_vlm"', '[model]\narch = "qwen2_vl"\n[data]\nsource = "images"\n[train]\ncompile = "best_effort"\n',
     "[[runs]][0].train.compile: mlx-vlm compiles its whole step or not at all"),
    ('kind = "mlx_vlm"', '[model]\narch = "qwen2_vl"\n[data]\nsource = "images"\neval_rows = 8\n',
     "[[runs]][0].train.eval_batch: mlx-vlm evaluates in batches of the training batch size: set eval_batch = 8"),
    ('kind = "reference"', '[[runs]]\nname = "b"\nworld_size = 1\ntrainer = { kind = "mlx_lm" }\n',
     "[[runs]][0].trainer: only a throughput scenario times several trainers"),
    ('kind = "mlx_vlm"', '[model]\narch = "qwen2_vl"\n[data]\nsource = "images"\n[train]\neval_batch = 8\n'
                         '[[runs]]\nname = "p"\nworld_size = 1\nstop_after = 2\n',
     "[[runs]][0].resume_from: resume is not supported for the mlx_vlm trainer yet (reference, mlx_lm can resume)"),
    ('kind = "mlx_lm"', "[data]\nstreaming = true\n", "[[runs]][0].data.streaming: the mlx_lm trainer takes an "
                                                        "in-memory dataset (reference, unsloth_zoo can read a stream)"),
    (UNSLOTH, '[train]\nlr_schedule = "linear"\n', "[[runs]][0].train.lr_schedule: unsloth-zoo's schedules that "
                                                    "match the scenario's are constant, cosine"),
    (UNSLOTH, '[data]\norder = "length_sorted"\n', "[[runs]][0].data.order: unsloth-zoo takes 'ordered'"),
    (UNSLOTH, "[train]\nglobal_batch = 6\n[[runs]]\nname = \"b\"\nworld_size = 4\n",
     "[[runs]][0].world_size: unsloth-zoo takes a per-rank batch: the 6 rows of each micro-step do not divide"),
])
def test_settings_a_trainer_cannot_honour_are_bad_input(tmp_path: Path, trainer: str, extra: str,
                                                        needle: str) -> None:
    if "unsloth" in trainer:
        needs_unsloth()
    path = tmp_path / "bad.toml"
    path.write_text(f'[scenario]\nname = "bad"\n\n[trainer]\n{trainer}\n\n{extra}\n[[runs]]\nname = "a"\n'
                    f"world_size = 1\n")
    p = cli("run", str(path), "--out", str(tmp_path / "o"))
    assert p.returncode == 2 and needle in p.stderr and p.stderr.count("\n") == 1, p.stderr


def test_the_api_outside_the_harness_says_so() -> None:
    from harness import api

    with pytest.raises(api.NotUnderHarness, match="not running under mlx-ddp-harness"):
        api.session()


MLX_LM_PART = """
[scenario]
name = "{name}"
seed = 3

[trainer]
kind = "mlx_lm"
fine_tune = "lora"

[model]
arch = "llama"

[data]
rows = 16
response_only = false

[train]
steps = 4
global_batch = 8

[[runs]]
name = "part"
world_size = 2
stop_after = 3
"""


@pytest.mark.ranks
def test_mlx_lm_resumes_from_kept_adapter_files_and_a_damaged_one_is_bad_input(tmp_path: Path) -> None:
    """A 2-rank mlx-lm run stops after step 3; its adapter files, kept, are resumed from by path at
    world size 1 (mlx-lm's saves do not depend on the world size). An empty directory, or a
    truncated adapter file, is refused before anything starts, in one line naming it."""
    first = tmp_path / "makes.toml"
    first.write_text(MLX_LM_PART.format(name="makes"))
    out = tmp_path / "out"
    p = cli("run", str(first), "--out", str(out), "--keep-checkpoints")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    kept = out / "runs" / "makes" / "part" / "checkpoints"
    assert sorted(f.name for f in (kept / "rank0.mlx_lm").iterdir()) == [
        "adapters.safetensors", "adapters_step.json"]  # no step-3 save by cadence: the final file holds step 3
    assert not (kept / "rank1.mlx_lm").exists()  # mlx-lm saves on rank 0 only: rank 1's folder stayed empty
    later = tmp_path / "continues.toml"
    later.write_text(MLX_LM_PART.format(name="continues").replace("world_size = 2", "world_size = 1").replace(
        "stop_after = 3\n", f'resume_from = "{kept}"\nexpect_resume_step = 3\n'))
    p = cli("run", str(later), "--out", str(tmp_path / "later"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    run = json.loads((tmp_path / "later" / "result.json").read_text())["scenarios"][0]["runs"][0]
    assert run["resume"]["identity"].startswith("adapters.safetensors (") and run["steps"] == 4
    assert run["history_start"] == 4 and len(run["losses"]) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    for source, needle in ((empty, f"no adapter file to resume from in {empty}"),
                           (kept, f"cannot read adapter file {kept / 'rank0.mlx_lm' / 'adapters.safetensors'}")):
        if source == kept:
            damaged = kept / "rank0.mlx_lm" / "adapters.safetensors"
            damaged.write_bytes(damaged.read_bytes()[:100])
        bad = tmp_path / "bad.toml"
        bad.write_text(later.read_text().replace(str(kept), str(source)))
        p = cli("run", str(bad), "--out", str(tmp_path / "later"))
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert p.stderr.startswith(f"error: {bad}: [[runs]][0].resume_from: {needle}"), p.stderr
    assert json.loads((tmp_path / "later" / "result.json").read_text())["passed"]  # the earlier result is kept
