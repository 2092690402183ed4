"""``mlx-ddp-harness new``: the file it writes runs as written with real ranks; bad flags are refused
in one line (exit 2) and an existing file is never overwritten."""

from __future__ import annotations

import importlib.util
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
