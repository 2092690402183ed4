"""Real prose and BPE tokenizers made before a run: cached, disjoint, readable by the ranks' own
code, and bad settings refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.controller import inputs
from harness.data.sources import jsonl_rows
from harness.data.tokenizers import FileTokenizer
from harness.scenario import DataSpec, ScenarioError, load_scenario
from tests.conftest import write_scenario


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MLX_DDP_HARNESS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_prose_rows_are_real_paragraphs_and_eval_rows_are_held_out(cache: Path) -> None:
    paras = inputs.prose_paragraphs()
    assert len(paras) > 1000 and all(len(p.strip()) >= inputs.MIN_PARAGRAPH_CHARS for p in paras)
    train, held = inputs.prose_files(100, 20, "x")
    train_rows = [r["text"] for _, r in jsonl_rows(train, None)]
    held_rows = [r["text"] for _, r in jsonl_rows(held, None)]
    assert len(held_rows) == 20 and held_rows == paras[-20:]
    assert train_rows == paras[:-20] and not set(held_rows) & set(train_rows[:100])
    lengths = sorted(len(t) for t in train_rows[:100])
    assert lengths[-1] > 5 * lengths[0]  # rows of very different lengths
    assert {p.parent for p in (train, held)} == {cache}


def test_prepared_files_are_cached_not_rewritten(cache: Path) -> None:
    first, _ = inputs.prose_files(50, 0, "x")
    mtime = first.stat().st_mtime_ns
    again, held = inputs.prose_files(50, 0, "x")
    assert again == first and again.stat().st_mtime_ns == mtime and held is None


def test_bpe_tokenizer_is_trained_once_and_has_the_special_tokens() -> None:
    texts = [p for p in inputs.prose_paragraphs()[:200]]
    path = inputs.bpe_tokenizer(texts, 512)
    assert inputs.bpe_tokenizer(texts, 512) == path
    tok = FileTokenizer(str(path))
    assert tok.vocab_size == 512 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    ids = tok.encode("The assert statement is a convenient way to insert debugging assertions")
    assert 0 < len(ids) < 40  # a subword vocabulary: fewer tokens than the 70 bytes


def test_prepare_turns_prose_and_bpe_into_local_files(tmp_path: Path) -> None:
    path = write_scenario(tmp_path, "prose", extra="")
    path.write_text(path.read_text().replace("[data]\n", '[data]\nsource = "prose"\ntokenizer = "bpe:400"\n'
                                                         "eval_rows = 5\n"))
    s = inputs.prepare(load_scenario(path))
    assert s.data.source == "jsonl" and Path(s.data.path).is_file() and Path(s.data.eval_path).is_file()
    assert Path(s.data.tokenizer).name.startswith("bpe400-")


@pytest.mark.parametrize("data, key, message", [
    ('source = "prose"\nformat = "chat"', "[data].format", "prose rows are plain text"),
    ('tokenizer = "bpe:12"', "[data].tokenizer", "between 300 and 65536"),
    ('tokenizer = "bpe:many"', "[data].tokenizer", "between 300 and 65536"),
])
def test_bad_prose_or_bpe_settings_are_refused(tmp_path: Path, data: str, key: str, message: str) -> None:
    path = write_scenario(tmp_path, "bad")
    path.write_text(path.read_text().replace("[data]\n", f"[data]\n{data}\n"))
    with pytest.raises(ScenarioError) as e:
        load_scenario(path)
    assert key in str(e.value) and message in str(e.value)


def test_more_prose_rows_than_exist_is_refused_before_launch() -> None:
    with pytest.raises(ScenarioError, match=r"rows \(99999\) \+ eval_rows \(0\) exceed"):
        inputs.prepare_data(DataSpec(source="prose", rows=99999), 0, "s.toml: [data]")
