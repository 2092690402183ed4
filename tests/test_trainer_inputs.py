"""The reference trainer's inputs under real ranks: a local model directory, a local tokenizer.json,
and determinism (same seed, same bits)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harness.controller.run_job import execute
from harness.controller.scenario_runs import run_plan
from harness.data.sources import generated_text
from harness.judge.verdict import judge
from harness.scenario import load_scenario
from harness.scenario.plan import job_for, plan_scenario
from tests.conftest import cli, write_scenario

pytestmark = pytest.mark.ranks


def run_all(path: Path):  # noqa: ANN201
    """Every run of the scenario (step-local probes and noise-floor runs included), all completed."""
    s = load_scenario(path)
    runs = run_plan(plan_scenario(s))
    for r in runs:
        assert r.ok, r.failure
    return s, runs


def assert_checks_pass(s, runs) -> None:  # noqa: ANN001
    failed = [c for c in judge(plan_scenario(s), runs) if not c.passed]
    assert not failed, failed


def make_model_dir(dest: Path, seed: int) -> None:
    """A local mlx-lm model directory (config.json + model.safetensors) with seed-``seed`` weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from harness.rank.models import build_model
    from harness.scenario import ModelSpec

    model, config = build_model(ModelSpec(arch="qwen3"), 259, seed)
    dest.mkdir()
    (dest / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())))


def test_local_model_directory_is_loaded_and_trains_in_parity(scenario_dir: Path) -> None:
    make_model_dir(scenario_dir / "tiny-model", seed=99)
    path = write_scenario(scenario_dir, "from_dir", world_sizes=(1, 2))
    path.write_text(path.read_text().replace('arch = "qwen3"', 'arch = "qwen3"\npath = "tiny-model"'))
    s, runs = run_all(path)
    assert_checks_pass(s, runs)
    # The weights came from the directory (seed 99), not from the scenario seed (7).
    seed99 = write_scenario(scenario_dir, "seed99")
    seed99.write_text(seed99.read_text().replace("seed = 7", "seed = 99"))
    seed7 = write_scenario(scenario_dir, "seed7")
    # Same data (seed 7 rows) is not guaranteed for seed 99, so compare the initial weights' digest
    # (taken where start_parity compares runs' starts: the scenarios' one-rank runs alone).
    r99, r7 = (execute("single", job_for(load_scenario(p), "single"), 1) for p in (seed99, seed7))
    assert r99.ok and r7.ok, (r99.failure, r7.failure)
    assert runs[0].result()["digests"]["0"] == r99.result(0)["digests"]["0"]
    assert runs[0].result()["digests"]["0"] != r7.result(0)["digests"]["0"]


def make_tokenizer(dest: Path, specials: tuple[str, ...] = ("<pad>", "<s>", "</s>")):  # noqa: ANN201
    """A byte-level BPE trained offline on generated text, with ``specials`` (ids 0, 1, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = np.random.default_rng(3)
    tok.train_from_iterator([generated_text(rng, 24, 120) for _ in range(300)], trainer)
    tok.save(str(dest))
    return tok


def test_local_tokenizer_json_is_used(scenario_dir: Path) -> None:
    tok = make_tokenizer(scenario_dir / "tokenizer.json")

    bpe = write_scenario(scenario_dir, "bpe", world_sizes=(1, 2))
    bpe.write_text(bpe.read_text().replace("max_chars = 60", 'max_chars = 60\ntokenizer = "tokenizer.json"'))
    s, runs = run_all(bpe)
    assert_checks_pass(s, runs)
    assert runs[0].result()["model_config"]["vocab_size"] == tok.get_vocab_size()
    _, (byte_run,) = run_all(write_scenario(scenario_dir, "bytes", world_sizes=(1,)))
    assert runs[0].result()["tokens_global"] < byte_run.result()["tokens_global"]  # BPE merges bytes


def test_a_tokenizer_without_special_tokens_is_said_before_the_run(scenario_dir: Path) -> None:
    from harness.data.tokenizers import FileTokenizer

    make_tokenizer(scenario_dir / "eos_only.json", ("</s>",))
    notes = FileTokenizer(str(scenario_dir / "eos_only.json")).notes
    assert notes == ["no pad token (<pad>, <|pad|>, [PAD]): batches are padded with the eos token </s> (id 0), "
                     "masked out of the loss", "no bos token (<s>, <|begin_of_text|>, <bos>, <|endoftext|>): "
                     "rows start without one"]
    make_tokenizer(scenario_dir / "bare.json", ())
    bare = FileTokenizer(str(scenario_dir / "bare.json"))
    assert bare.pad_id == 0 and bare.bos_id is None and bare.eos_id is None
    assert bare.notes[0].endswith("batches are padded with id 0, masked out of the loss") and len(bare.notes) == 3
    make_tokenizer(scenario_dir / "full.json")
    assert FileTokenizer(str(scenario_dir / "full.json")).notes == []

    path = write_scenario(scenario_dir, "bare", world_sizes=(1, 2), steps=3)
    path.write_text(path.read_text().replace("max_chars = 60", 'max_chars = 60\ntokenizer = "bare.json"'))
    p = cli("run", str(path))
    assert p.returncode == 0, p.stdout + p.stderr  # padding with id 0 is masked: parity holds
    assert f"bare: {scenario_dir / 'bare.json'}: no pad token (<pad>, <|pad|>, [PAD]): batches are padded with id 0" \
        in p.stderr


def test_same_seed_same_bits_and_other_seed_differs(scenario_dir: Path) -> None:
    a = run_all(write_scenario(scenario_dir, "a", world_sizes=(2,)))[1][0]
    b = run_all(write_scenario(scenario_dir, "b", world_sizes=(2,)))[1][0]
    other = write_scenario(scenario_dir, "c", world_sizes=(2,))
    other.write_text(other.read_text().replace("seed = 7", "seed = 8"))
    c = run_all(other)[1][0]
    assert a.result()["losses"] == b.result()["losses"]
    assert a.result()["final_digest"] == b.result()["final_digest"]
    assert a.result()["losses"] != c.result()["losses"]


@pytest.mark.parametrize("form", ["text", "prompt_completion"])
def test_jsonl_rows_with_tokenizer_json_pad_id_and_parity(scenario_dir: Path, form: str) -> None:
    tok = make_tokenizer(scenario_dir / "tokenizer.json")
    rng = np.random.default_rng(4)
    rows = [generated_text(rng, 20, 90) for _ in range(18)]
    recs = [{"text": t} if form == "text" else {"prompt": t[:15], "completion": t[15:]} for t in rows]
    (scenario_dir / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    path = write_scenario(scenario_dir, f"jsonl_{form}", world_sizes=(1, 2))
    path.write_text(path.read_text().replace(
        "rows = 21", 'source = "jsonl"\npath = "rows.jsonl"\ntokenizer = "tokenizer.json"\nrows = 18'))
    s, runs = run_all(path)
    assert_checks_pass(s, runs)
    for run in runs:
        assert all(o.result["data"]["pad_id"] == tok.token_to_id("<pad>") for o in run.ranks)
        assert sum(o.result["data"]["rows_held"] for o in run.ranks) == 18  # each rank holds its share
