"""Trainers under test (``[trainer] kind``): real ranks under mlx.launch, through the CLI.

The shipped adapter scenarios (mlx_lm_parity, mlx_lm_lora, mlx_lm_mean_of_means, script_example)
run in tests/test_scenarios.py; here: a user's script with real DDP bugs is caught, a broken
trainer fails with one line naming it (exit 3), and settings a trainer cannot honour are bad input.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, cli, needs_unsloth

EXAMPLE = REPO / "examples" / "ddp_train.py"


def script_scenario(d: Path, script: str, name: str = "script", world_sizes: tuple[int, ...] = (1, 2),
                    extra: str = "", no_progress_s: int = 60) -> Path:
    (d / f"{name}.py").write_text(script)
    runs = "".join(f'\n[[runs]]\nname = "{"single" if n == 1 else f"ddp{n}"}"\nworld_size = {n}\n'
                   for n in world_sizes)
    reference = '[checks]\nreference = "single"\n' if 1 in world_sizes else ""
    body = textwrap.dedent(f"""
        [scenario]
        name = "{name}"
        seed = 5

        [trainer]
        kind = "script"
        path = "{name}.py"

        [model]
        arch = "llama"

        [data]
        format = "prompt_completion"
        rows = 32

        [train]
        steps = 6
        global_batch = 8
        digest_every = 3

        [limits]
        wall_s = 240
        no_progress_s = {no_progress_s}
        """) + runs + "\n" + reference + extra
    path = d / f"{name}.toml"
    path.write_text(body)
    return path


@pytest.mark.ranks
def test_a_script_with_ddp_bugs_is_caught(tmp_path: Path) -> None:
    """The example with two real bugs: each rank's gradient of its own mean loss (the mean of
    per-rank means) and a save on every rank. Parity and the rank-0 check fail; exit 1."""
    src = EXAMPLE.read_text()
    buggy = src.replace("scaled(grads, size / tokens)", "scaled(grads, 1 / tokens_local)")
    buggy = buggy.replace("if rank == 0:  # save once, on rank 0", "if True:")
    assert buggy.count("1 / tokens_local") == 1 and "if True:" in buggy
    path = script_scenario(tmp_path, buggy)
    p = cli("run", str(path), "--out", str(tmp_path / "o"))
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    checks = {(c["name"], c["run"]): c for c in json.loads((tmp_path / "o" / "result.json").read_text())
              ["scenarios"][0]["checks"]}
    assert checks[("param_parity", "ddp2")]["result"] == "FAIL"
    assert checks[("param_parity", "ddp2")]["value"] > 10 * checks[("param_parity", "ddp2")]["limit"]
    assert checks[("rank0_side_effects", "ddp2")]["result"] == "FAIL"
    assert checks[("rank0_side_effects", "single")]["result"] == "pass"
    assert checks[("step_grad_parity", "ddp2")]["result"] == "n/a"  # never reported as passed


HEAD = "from harness import api\nrun = api.session()\n"


@pytest.mark.ranks
@pytest.mark.parametrize(("script", "line"), [
    (HEAD + "raise RuntimeError('boom')\n", "trainer script broken.py raised RuntimeError: boom"),
    (HEAD + "import sys\nsys.exit(4)\n", "trainer script broken.py exited with status 4"),
    (HEAD + "pass\n", "trainer script broken.py reported no steps"),
    (HEAD + "run.step(1, 1.0, 10, 5)\n", "trainer script broken.py never handed over its final parameters"),
    (HEAD + "import time\nrun.step(1, 1.0, 10, 5)\ntime.sleep(600)\n",
     "trainer script: watchdog: no progress from any rank for 4 s"),
], ids=["raises", "exits", "reports-nothing", "no-params", "hangs"])
def test_a_broken_script_fails_with_one_line_naming_it(tmp_path: Path, script: str, line: str) -> None:
    path = script_scenario(tmp_path, script, name="broken", world_sizes=(2,), no_progress_s=4)
    p = cli("run", str(path), "--out", str(tmp_path / "o"))
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-2000:]
    assert line in p.stdout, p.stdout[-3000:]
    assert "survived" not in p.stdout  # the process group is gone
    doc = json.loads((tmp_path / "o" / "result.json").read_text())
    assert doc["exit_code"] == 3 and doc["scenarios"][0]["status"] == "error"


def run_faulted(tmp_path: Path, scenario: str) -> str:
    """The shipped scenario at 1 and 2 ranks for 4 steps, rank 1 raising at step 2 of the 2-rank
    run: exit 3, no stray process; returns the printed output."""
    body = (REPO / "scenarios" / f"{scenario}.toml").read_text()
    body = body.replace('[[runs]]\nname = "ddp4"\nworld_size = 4\n', "").replace("steps = 12", "steps = 4")
    body += '\n[[faults]]\nrank = 1\nstep = 2\naction = "raise"\nruns = ["ddp2"]\n'
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


UNSLOTH = 'kind = "unsloth_zoo"'


@pytest.mark.parametrize(("trainer", "extra", "needle"), [
    ('kind = "mlx_lm"', "[train]\nmax_grad_norm = 1.0\n", "[[runs]][0].train.max_grad_norm: mlx-lm's trainer does "
                                                          "not clip gradients"),
    ('kind = "script"', "", "[trainer].path: a 'script' trainer needs the path of a Python training script"),
    ('kind = "script"\npath = "nowhere.py"', "", "[trainer].path: path does not exist"),
    ('kind = "mlx_vlm2"', "", "[trainer].kind: must be one of"),
    ('kind = "reference"\nfine_tune = "lora"', "", "[trainer].fine_tune: LoRA is an option of the 'mlx_lm', "
                                                    "'mlx_vlm', 'unsloth_zoo' trainers"),
    ('kind = "mlx_vlm"', "", "[model].arch: the mlx_vlm trainer trains vision-language models (qwen2_vl, paligemma)"),
    ('kind = "mlx_vlm"', '[model]\narch = "qwen2_vl"\n[data]\nsource = "images"\n[train]\ncompile = "best_effort"\n',
     "[[runs]][0].train.compile: mlx-vlm compiles its whole step or not at all"),
    ('kind = "mlx_vlm"', '[model]\narch = "qwen2_vl"\n[data]\nsource = "images"\neval_rows = 8\n',
     "[[runs]][0].train.eval_batch: mlx-vlm evaluates in batches of the training batch size: set eval_batch = 8"),
    ('kind = "reference"', '[[runs]]\nname = "b"\nworld_size = 1\ntrainer = { kind = "mlx_lm" }\n',
     "[[runs]][0].trainer: only a throughput scenario times several trainers"),
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
