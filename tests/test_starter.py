"""``mlx-ddp-harness new``: the file it writes runs as written with real ranks; bad flags are refused
in one line (exit 2) and an existing file is never overwritten."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from harness.scenario import load_scenario
from tests.conftest import REPO, cli
from tests.test_trainer_inputs import make_tokenizer


@pytest.mark.ranks
def test_the_default_starter_runs_as_written(tmp_path: Path) -> None:
    p = cli("new", "mine.toml", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "wrote mine.toml: 2 runs (single, ddp2); run it: mlx-ddp-harness run mine.toml"
    text = (tmp_path / "mine.toml").read_text()
    assert text.startswith("# mine: does the harness's reference DDP trainer train the same under DDP as in one "
                           "process?")
    s = load_scenario(tmp_path / "mine.toml")
    assert [(r.name, r.world_size) for r in s.runs] == [("single", 1), ("ddp2", 2)] and s.checks.reference == "single"
    run = cli("run", "mine.toml", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "mine: PASSED" in run.stdout and "eval_parity" in run.stdout  # held-out rows: the sharded eval is judged


@pytest.mark.ranks
def test_a_starter_on_your_rows_and_tokenizer_runs_as_written(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(REPO / "scenarios" / "data" / "chat.jsonl", data / "chat.jsonl")
    make_tokenizer(data / "tokenizer.json")
    (tmp_path / "suite").mkdir()
    p = cli("new", "suite/chat.toml", "--data", "data/chat.jsonl", "--tokenizer", "data/tokenizer.json",
            "--world-sizes", "1,2", "--steps", "6", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "suite" / "chat.toml").read_text()
    assert 'path = "../data/chat.jsonl"' in text and 'tokenizer = "../data/tokenizer.json"' in text  # portable
    run = cli("run", "suite/chat.toml", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "step_grad_parity" in run.stdout and "chat: PASSED" in run.stdout


@pytest.mark.ranks
def test_a_starter_for_your_script_runs_as_written(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    shutil.copy(REPO / "examples" / "ddp_train.py", script)
    p = cli("new", "mine.toml", "--script", "train.py", "--world-sizes", "1,2", "--steps", "4", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    s = load_scenario(tmp_path / "mine.toml")
    assert s.trainer.kind == "script" and Path(s.trainer.path) == script.resolve()
    run = cli("run", "mine.toml", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("kind", ["mlx_lm", "mlx_vlm", "unsloth_zoo"])
def test_a_starter_for_each_trainer_kind_is_a_valid_scenario(tmp_path: Path, kind: str) -> None:
    if importlib.util.find_spec(kind) is None:
        pytest.skip(f"{kind} is not installed")
    p = cli("new", f"{kind}.toml", "--trainer", kind, "--world-sizes", "1,2,4", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    s = load_scenario(tmp_path / f"{kind}.toml")
    assert s.trainer.kind == kind and [r.world_size for r in s.runs] == [1, 2, 4] and s.train.global_batch % 4 == 0


def test_bad_flags_are_refused_in_one_line_and_nothing_is_overwritten(tmp_path: Path) -> None:
    kept = tmp_path / "kept.toml"
    kept.write_text("# mine\n")
    cases = [
        (("new", "kept.toml"), "kept.toml: exists; give another name (nothing was written)"),
        (("new", "a.toml", "--world-sizes", "1,two"), "--world-sizes: expected distinct rank counts such as 1,2,4"),
        (("new", "a.toml", "--world-sizes", "2,2"), "--world-sizes: expected distinct rank counts"),
        (("new", "a.toml", "--data", "nowhere.jsonl"), "--data: nowhere.jsonl: no such file"),
        (("new", "a.toml", "--trainer", "torchtune"), "--trainer: unknown kind 'torchtune'; one of reference"),
        (("new", "a.txt"), "a.txt: a scenario file ends in .toml"),
        (("new", "no/such/dir/a.toml"), "no/such/dir: no such directory"),
    ]
    for args, message in cases:
        p = cli(*args, cwd=tmp_path)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert kept.read_text() == "# mine\n" and sorted(f.name for f in tmp_path.iterdir()) == ["kept.toml"]


def test_a_scenario_the_checks_refuse_is_not_written(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text('{"text": "only one row"}\n')
    p = cli("new", "one.toml", "--data", "rows.jsonl", "--world-sizes", "1,2", cwd=tmp_path)
    assert p.returncode == 2 and "one.toml" in p.stderr and "tmp" not in Path(p.stderr.split(":")[0]).name
    assert not (tmp_path / "one.toml").exists() and not list(tmp_path.glob("*.toml"))


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_a_script_that_never_imports_harness_api_is_refused_unless_forced(tmp_path: Path) -> None:
    from harness.present.starter_blocks import uses_harness_api

    (tmp_path / "train.py").write_text("import mlx.core as mx\n\nprint(mx.zeros(3))  # trains, reports nothing\n")
    p = cli("new", "mine.toml", "--script", "train.py", cwd=tmp_path)
    assert p.returncode == 2 and p.stdout == ""
    assert _one_line(p.stderr) == ("error: train.py never imports harness.api, so its runs will report no steps: "
                                   "docs/scripts.md shows the calls a script makes (nothing was written; --force "
                                   "writes it anyway)")
    assert not (tmp_path / "mine.toml").exists() and sorted(f.name for f in tmp_path.iterdir()) == ["train.py"]

    forced = cli("new", "mine.toml", "--script", "train.py", "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert _one_line(forced.stderr).startswith("warning: train.py never imports harness.api, so its runs will report "
                                               "no steps: docs/scripts.md")
    assert load_scenario(tmp_path / "mine.toml").trainer.kind == "script"

    for text, uses in (("from harness import api\n", True), ("import harness.api as h\n", True),
                       ("from harness.api import run_context\n", True), ("from harness import (\n    api,\n)\n", True),
                       ("import harness\n# the api, later\n", False), ("from harness import apis\n", False)):
        (tmp_path / "t.py").write_text(text)
        assert uses_harness_api(tmp_path / "t.py") is uses, text


def _rows(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_mlx_lm_on_rows_of_uneven_tokens_writes_the_documented_expected_failure(tmp_path: Path) -> None:
    """The block is decided by the rows as the trainer tokenizes them: equal characters are equal
    tokens in bytes, and unequal ones under a BPE tokenizer that merges common words."""
    from harness.data.tokenizers import FileTokenizer

    shipped = load_scenario(REPO / "scenarios" / "mlx_lm_mean_of_means.toml").checks.expected_failures
    words = "the red cat sees the blue dog in the barn"
    noise = ("qzx vkw jqp " * 10)[: len(words)]
    make_tokenizer(tmp_path / "tokenizer.json")
    bpe = FileTokenizer(str(tmp_path / "tokenizer.json"))
    assert len(bpe.encode(words)) < len(bpe.encode(noise))  # the same characters, other token counts
    _rows(tmp_path / "even.jsonl", [words, noise] * 8)

    even = cli("new", "even.toml", "--trainer", "mlx_lm", "--data", "even.jsonl", cwd=tmp_path)
    assert even.returncode == 0, even.stderr
    assert even.stdout.startswith("wrote even.toml") and "expected_failures" not in (tmp_path / "even.toml").read_text()
    assert load_scenario(tmp_path / "even.toml").checks.expected_failures == {}

    uneven = cli("new", "bpe.toml", "--trainer", "mlx_lm", "--data", "even.jsonl", "--tokenizer", "tokenizer.json",
                 cwd=tmp_path)
    assert uneven.returncode == 0, uneven.stderr
    said, wrote = uneven.stdout.strip().splitlines()
    lo, hi = sorted({len(bpe.encode(t)) + 1 for t in (words, noise)})  # + the end-of-sequence token
    assert said == ("added the expected failures [checks.expected_failures.mean_of_means]: mlx-lm's loss and gradient "
                    "are the mean of the ranks' mean losses, not weighted by tokens (mlx-lm 0.32.2), and these rows "
                    f"hold {lo} to {hi} supervised tokens each, so ddp2 will not match single (docs/trainers.md)")
    assert wrote.startswith("wrote bpe.toml: 2 runs (single, ddp2)")
    s = load_scenario(tmp_path / "bpe.toml")
    assert s.checks.expected_failures == {"mean_of_means": shipped["mean_of_means"]}  # the documented block

    thr = cli("new", "thr.toml", "--trainer", "mlx_lm", "--data", "even.jsonl", "--tokenizer", "tokenizer.json",
              "--throughput", cwd=tmp_path)  # no parity, so nothing to expect
    assert thr.returncode == 0 and load_scenario(tmp_path / "thr.toml").checks.expected_failures == {}
    ref = cli("new", "ref.toml", "--data", "even.jsonl", "--tokenizer", "tokenizer.json", cwd=tmp_path)
    assert ref.returncode == 0 and load_scenario(tmp_path / "ref.toml").checks.expected_failures == {}


def test_rows_mlx_lm_cannot_train_are_refused_as_the_trainer_would(tmp_path: Path) -> None:
    shutil.copy(REPO / "scenarios" / "data" / "chat.jsonl", tmp_path / "chat.jsonl")  # answers past 128 tokens
    p = cli("new", "chat.toml", "--trainer", "mlx_lm", "--data", "chat.jsonl", cwd=tmp_path)
    assert p.returncode == 2 and not (tmp_path / "chat.toml").exists() and not list(tmp_path.glob("*.toml"))
    assert _one_line(p.stderr).endswith("chat.jsonl:1: no supervised tokens, as mlx_lm gets the row ([data] "
                                        "max_seq_len = 128 keeps a row's first tokens)")


def test_mlx_vlm_on_captions_of_uneven_length_writes_the_documented_expected_failure(tmp_path: Path) -> None:
    if importlib.util.find_spec("mlx_vlm") is None:
        pytest.skip("mlx_vlm is not installed")
    shipped = load_scenario(REPO / "scenarios" / "mlx_vlm_mean_of_means.toml").checks.expected_failures
    p = cli("new", "vlm.toml", "--trainer", "mlx_vlm", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("added the expected failures [checks.expected_failures.mean_of_means]: mlx-vlm's "
                               "gradient is the mean of the ranks' mean-loss gradients")
    assert load_scenario(tmp_path / "vlm.toml").checks.expected_failures == shipped


@pytest.mark.ranks
def test_a_lora_starter_runs_as_written(tmp_path: Path) -> None:
    """mlx-lm with LoRA on the generated rows (of different lengths): the known behaviour is shown."""
    if importlib.util.find_spec("mlx_lm") is None:
        pytest.skip("mlx_lm is not installed")
    p = cli("new", "lora.toml", "--trainer", "mlx_lm", "--lora", "--steps", "4", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("added the expected failures") and "wrote lora.toml: 2 runs" in p.stdout
    s = load_scenario(tmp_path / "lora.toml")
    t = s.trainer
    assert (t.kind, t.fine_tune, t.lora_rank, t.lora_scale, t.lora_layers) == ("mlx_lm", "lora", 8, 20.0, -1)
    assert (tmp_path / "lora.toml").read_text().startswith("# lora: does mlx-lm's trainer (mlx_lm.tuner.trainer.train)"
                                                           " with LoRA adapters train the same under DDP")
    run = cli("run", "lora.toml", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "lora: PASSED" in run.stdout and "fine-tune: lora" in run.stdout
    assert re.search(r"^param_parity +ddp2 .* xfail ", run.stdout, re.M), run.stdout  # adapters compared, shown


@pytest.mark.ranks
def test_a_throughput_starter_runs_as_written(tmp_path: Path) -> None:
    p = cli("new", "speed.toml", "--throughput", "--world-sizes", "1,2", "--steps", "4", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    s = load_scenario(tmp_path / "speed.toml")
    assert s.kind == "throughput" and s.checks.reference == "single" and s.data.eval_rows == 0
    assert [(r.name, s.for_run(r).train.global_batch) for r in s.runs] == [("single", 4), ("ddp2", 8)]
    run = cli("run", "speed.toml", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Throughput vs single" in run.stdout and re.search(r"^\S.* ddp2 .* \d+\.\d\dx ", run.stdout, re.M)


def test_lora_and_throughput_flags_are_refused_where_they_cannot_apply(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text('{"text": "a row"}\n{"text": "another row"}\n')
    for args, message in ((("--lora",), "error: --lora: the harness's reference DDP trainer has no LoRA; the trainer "
                                        "kinds with LoRA: mlx_lm, mlx_vlm, unsloth_zoo, script (--trainer KIND)"),
                          (("--lora", "--command", "rows.jsonl"), "error: --lora: any executable reporting through "
                                                                  "the rank protocol has no LoRA"),
                          (("--throughput", "--eval-data", "rows.jsonl"), "error: --eval-data: a throughput scenario "
                                                                          "times training only")):
        p = cli("new", "a.toml", *args, cwd=tmp_path)
        assert p.returncode == 2 and _one_line(p.stderr).startswith(message), (args, p.stderr)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["rows.jsonl"]
    # a script's LoRA: run.model() adds the adapters, which the script trains and hands over
    (tmp_path / "train.py").write_text("from harness import api\n")
    p = cli("new", "lora.toml", "--script", "train.py", "--lora", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "lora.toml").read_text()
    assert 'fine_tune = "lora"  # run.model() returns the model frozen, with LoRA adapters' in text
    assert "model.trainable_parameters() and hand them to run.step and run.finish" in text
