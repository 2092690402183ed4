"""Inputs the controller makes before any rank starts, cached on disk: real English prose from
the Python standard library, and byte-level BPE tokenizers trained on a scenario's own rows.

- ``[data] source = "prose"``: the paragraphs of the documentation topics every CPython ships
  (``pydoc_data.topics``, the text ``help()`` shows: the language reference's prose and its
  examples), one JSONL ``{"text"}`` row each. The first ``rows`` paragraphs are the train rows,
  the last ``eval_rows`` the held-out rows, so the two never overlap. The ranks read them through
  the local JSONL path like any user's file. The text differs between Python versions, so the
  cached file is named after the version and its content digest.
- ``[data] tokenizer = "bpe:N"``: a byte-level BPE ``tokenizer.json`` of N tokens (with
  ``<pad>``, ``<s>`` and ``</s>``), trained with the ``tokenizers`` package on the train rows the
  run reads, and cached under the digest of that text. A tokenizer is trained once and read by
  every rank, so every rank encodes alike.

The cache is ``$MLX_DDP_HARNESS_CACHE``, else ``$XDG_CACHE_HOME/mlx-ddp-harness``, else
``~/.cache/mlx-ddp-harness``; files are written to a temporary name and renamed, so processes
that prepare the same input at once never see half a file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from harness.scenario import DataSpec, Scenario, ScenarioError
from harness.scenario.job import TrainJob
from harness.scenario.plan import ScenarioPlan

MIN_PARAGRAPH_CHARS = 40
BPE_SPECIALS = ("<pad>", "<s>", "</s>")


def cache_dir() -> Path:
    root = os.environ.get("MLX_DDP_HARNESS_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-ddp-harness"


def _write_once(path: Path, text: str) -> Path:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


def prose_paragraphs() -> list[str]:
    """The documentation topics' paragraphs (in topic order), each at least 40 characters."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            para = para.strip("\n")
            if len(para.strip()) >= MIN_PARAGRAPH_CHARS:
                out.append(para)
    return out


def _jsonl(rows: list[str]) -> str:
    return "".join(json.dumps({"text": t}) + "\n" for t in rows)


def prose_files(rows: int, eval_rows: int, where: str) -> tuple[Path, Path | None]:
    """The train rows file (every paragraph but the held-out ones) and the eval rows file."""
    paras = prose_paragraphs()
    if rows + eval_rows > len(paras):
        raise ScenarioError(f"{where}: rows ({rows}) + eval_rows ({eval_rows}) exceed the {len(paras)} paragraphs "
                            f"of this Python's documentation topics")
    train = paras[: len(paras) - eval_rows]
    held = paras[len(paras) - eval_rows :]
    version = f"py{sys.version_info.major}{sys.version_info.minor}"

    def cached(kind: str, rows_: list[str]) -> Path:
        text = _jsonl(rows_)
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        return _write_once(cache_dir() / f"prose-{version}-{kind}-{digest}.jsonl", text)

    return cached("train", train), (cached("eval", held) if eval_rows else None)


def _texts(row: Any) -> list[str]:
    if isinstance(row, dict):
        if isinstance(row.get("messages"), list):
            return [m.get("content", "") for m in row["messages"] if isinstance(m, dict)]
        return [v for k, v in row.items() if k in ("text", "prompt", "completion", "caption") and isinstance(v, str)]
    return []


def bpe_tokenizer(texts: list[str], vocab: int) -> Path:
    """A byte-level BPE ``tokenizer.json`` of ``vocab`` tokens trained on ``texts`` (cached)."""
    import tokenizers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    h = hashlib.sha256(f"{vocab}:{tokenizers.__version__}".encode())
    for t in texts:
        h.update(t.encode() + b"\0")
    path = cache_dir() / f"bpe{vocab}-{h.hexdigest()[:12]}.tokenizer.json"
    if path.exists():
        return path
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(BPE_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return _write_once(path, tok.to_str())


def prepare_data(d: DataSpec, seed: int, where: str) -> dict[str, Any]:
    """The data keys that turn ``prose`` and ``bpe:N`` into local files (empty when none apply)."""
    from harness.data.sources import row_source

    out: dict[str, Any] = {}
    if d.source == "prose":
        train, held = prose_files(d.rows, d.eval_rows, where)
        out.update(source="jsonl", path=str(train), format="text")
        if held is not None:
            out["eval_path"] = str(held)
    if d.tokenizer.startswith("bpe:"):
        rows = row_source(dataclasses.replace(d, **out), seed, "train")
        try:
            texts = [t for _, row in rows() for t in _texts(row)]
        except (OSError, ValueError) as e:
            raise ScenarioError(f"{where}: cannot read the rows to train the tokenizer on: {e}") from e
        if not texts:
            raise ScenarioError(f"{where}: no text in the train rows to train a BPE tokenizer on")
        out["tokenizer"] = str(bpe_tokenizer(texts, int(d.tokenizer[4:])))
    return out


def prepare(s: Scenario) -> Scenario:
    """``s`` with its generated inputs made and named by their cached paths, for the scenario's
    data and each run's data overrides."""
    base = prepare_data(s.data, s.seed, f"{s.path}: [data]")
    runs = []
    for i, r in enumerate(s.runs):
        eff = s.for_run(r)
        mine = prepare_data(eff.data, eff.seed, f"{s.path}: [[runs]][{i}].data") if r.data else {}
        runs.append(dataclasses.replace(r, data={**r.data, **mine}) if mine else r)
    return dataclasses.replace(s, data=dataclasses.replace(s.data, **base), runs=runs)


def prepare_jobs(plan: ScenarioPlan) -> dict[str, TrainJob]:
    """Each run's job with its generated inputs made (once for runs that share them) and named by
    their cached paths, before any run starts."""
    made: dict[tuple[str, int], dict[str, Any]] = {}
    jobs = {}
    for run in plan.runs:
        src = run.inputs
        key = (repr(src.data), src.seed)
        if key not in made:
            made[key] = prepare_data(src.data, src.seed, f"{plan.scenario.path}: {src.key}")
        data = dataclasses.replace(run.job.scenario.data, **made[key])
        jobs[run.name] = dataclasses.replace(run.job, scenario=dataclasses.replace(run.job.scenario, data=data))
    return jobs
