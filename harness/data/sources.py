"""Where rows come from, and how a row becomes token ids with a loss mask.

Rows are read lazily (``open_rows`` returns a fresh iterator each epoch), so a rank can keep only
the rows it owns. Forms: ``{"text"}``, ``{"prompt", "completion"}`` and chat
``{"messages": [{"role", "content"}]}``. With ``response_only`` the loss covers completion /
assistant tokens (and their end-of-sequence token) only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.data.tokenizers import Tokenizer
from harness.scenario import DataSpec

COLORS = ("red", "green", "blue", "yellow", "black", "white", "purple", "orange")
ANIMALS = ("cat", "dog", "fox", "owl", "bee", "cow", "hen", "eel")
VERBS = ("sees", "likes", "chases", "finds", "hears", "meets")
PLACES = ("the barn", "the hill", "the river", "the wood", "the town")
ROLES = ("system", "user", "assistant")

# Separate, fixed RNG streams per use; all derive from the scenario seed, none is global.
TRAIN_STREAM, EVAL_STREAM = 1, 4

Row = dict[str, Any]
RowSource = Callable[[], Iterator[tuple[str, Row]]]  # yields (where, row); "where" names the row


@dataclass
class Example:
    """One tokenized row: ``supervised[i]`` is True when token i is a training target;
    ``vision`` holds a VLM row's image inputs (arrays that concatenate along axis 0 across rows)."""

    ids: np.ndarray
    supervised: np.ndarray
    vision: dict[str, np.ndarray] | None = None

    @property
    def tokens(self) -> int:
        return int(self.supervised[1:].sum())

    @property
    def images(self) -> int:
        return 0 if self.vision is None else 1

    @property
    def nbytes(self) -> int:
        extra = sum(a.nbytes for a in self.vision.values()) if self.vision else 0
        return int(self.ids.nbytes + self.supervised.nbytes + extra)


def empty_example(pad_id: int) -> Example:
    """A row with no supervised tokens: eval padding, so every rank runs the same batches."""
    return Example(np.array([pad_id, pad_id], dtype=np.int32), np.zeros(2, dtype=bool))


def _sentence(rng: np.random.Generator) -> tuple[str, str, str]:
    c1, c2 = rng.choice(COLORS, 2)
    a1, a2 = rng.choice(ANIMALS, 2)
    verb, place = rng.choice(VERBS), rng.choice(PLACES)
    return f"the {c1} {a1}", f"{verb} the {c2} {a2} in {place}", f"the {c2} {a2}"


def generated_text(rng: np.random.Generator, min_chars: int, max_chars: int) -> str:
    """One row of a small grammar: the loss falls as a model learns its words and structure."""
    target = int(rng.integers(min_chars, max_chars + 1))
    parts: list[str] = []
    while sum(len(p) + 1 for p in parts) < target:
        subject, rest, _ = _sentence(rng)
        n = int(rng.integers(1, 9))
        parts.append(f"{subject} {rest}, {n}+{n}={2 * n}.")
    return " ".join(parts)[:target]


def generated_row(rng: np.random.Generator, form: str, min_chars: int, max_chars: int) -> Row:
    """A generated row of ``form``: a question about a story, whose answer is in the story."""
    if form == "text":
        return {"text": generated_text(rng, min_chars, max_chars)}
    story = generated_text(rng, min_chars, max_chars)
    subject, rest, obj = _sentence(rng)
    question = f"{story} {subject} {rest}. what does {subject} {rest.split()[0][:-1]}?"
    if form == "prompt_completion":
        return {"prompt": question + " ", "completion": obj + "."}
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": obj + "."}]}


def detect_form(row: Any) -> str | None:
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("messages"), list):
        return "chat"
    if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        return "prompt_completion"
    if isinstance(row.get("text"), str):
        return "text"
    return None


def jsonl_rows(path: Path, limit: int | None) -> Iterator[tuple[str, Row]]:
    """The rows of a UTF-8 JSONL file (blank lines skipped), each named ``path:line``; a file
    that cannot be read, is not UTF-8 or has a line that is not JSON raises ``ValueError``
    naming the file (and the line)."""
    count, n = 0, 0
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):  # noqa: B007 - n names the line of a decoding error
                if limit is not None and count >= limit:
                    return
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not JSON ({e.msg})") from e
                count += 1
                yield where, row
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason}, at or after line {n + 1})") from e
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from e


def row_source(spec: DataSpec, seed: int, split: str = "train",
               read: Callable[[Path, int | None], Iterator[tuple[str, Row]]] | None = None,
               make: Callable[[np.random.Generator], Row] | None = None, eval_stream: int = EVAL_STREAM) -> RowSource:
    """A re-openable source of the train or eval split's rows: the split's JSONL file through
    ``read``, or ``make(rng)`` rows from a generator keyed by the seed and the split's stream
    (defaults: plain JSONL rows, the generated text corpus)."""
    read = read or jsonl_rows
    if split == "train" and spec.source == "jsonl":
        return lambda: read(Path(str(spec.path)), spec.rows)
    if split == "eval" and spec.eval_path is not None:
        return lambda: read(Path(spec.eval_path), None)
    count = spec.rows if split == "train" else spec.eval_rows
    stream = TRAIN_STREAM if split == "train" else eval_stream
    form = "text" if spec.format == "auto" else spec.format
    make = make or (lambda rng: generated_row(rng, form, spec.min_chars, spec.max_chars))

    def generate() -> Iterator[tuple[str, Row]]:
        rng = np.random.default_rng([seed, stream])
        for i in range(count):
            yield f"generated {split} row {i}", make(rng)

    return generate


def reject_presharded(source: Any) -> None:
    """Refuse an iterable that was already split per rank: the harness takes each rank's share."""
    marker = getattr(source, "_distributed", None) or getattr(source, "sharded_for_rank", None)
    if marker is not None:
        raise ValueError(
            f"the streaming source is already sharded per rank ({marker!r}); pass the whole stream, "
            "every rank takes its own disjoint share of it"
        )


FORM_KEYS = {"text": 'a "text" string', "prompt_completion": '"prompt" and "completion" strings',
             "chat": 'a "messages" list'}


def _shown(row: Any) -> str:
    """A row as a short JSON excerpt (a JSON array shows as one, not as a Python list)."""
    text = json.dumps(row, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


class Encoder:
    """Turns rows into ``Example``s; the first row fixes the form when ``format = "auto"``."""

    def __init__(self, tok: Tokenizer, spec: DataSpec):
        self.tok, self.max_len, self.response_only = tok, spec.max_seq_len, spec.response_only
        self.form: str | None = None if spec.format == "auto" else spec.format
        self.cut: list[tuple[str, int]] = []  # rows longer than ``max_len``: (where, their length in tokens)

    def pad_example(self) -> Example:
        return empty_example(self.tok.pad_id)

    def __call__(self, where: str, row: Any) -> Example:
        form = detect_form(row)
        if self.form is None and form is not None:
            self.form = form
        if form is None or form != self.form:
            want = (f"a row with {FORM_KEYS[self.form]}" if self.form is not None else
                    f"a JSON object with {', or '.join(FORM_KEYS.values())}")
            raise ValueError(f"{where}: expected {want}, got {_shown(row)}")
        ids, sup = [], []
        tok = self.tok

        def add(part: list[int], supervised: bool) -> None:
            ids.extend(part)
            sup.extend([supervised] * len(part))

        everything = not self.response_only
        if tok.bos_id is not None:
            add([tok.bos_id], False)
        eos = [tok.eos_id] if tok.eos_id is not None else []
        if form == "text":
            add(tok.encode(row["text"]) + eos, True)
        elif form == "prompt_completion":
            add(tok.encode(row["prompt"]), everything)
            add(tok.encode(row["completion"]) + eos, True)
        else:
            self._chat(where, row["messages"], add, eos, everything)
        if len(ids) > self.max_len:
            self.cut.append((where, len(ids)))
        ids, sup = ids[: self.max_len], sup[: self.max_len]
        if len(ids) < 2:
            raise ValueError(f"{where}: fewer than two tokens")
        return Example(np.array(ids, dtype=np.int32), np.array(sup, dtype=bool))

    def _chat(self, where: str, messages: list[Any], add: Any, eos: list[int], everything: bool) -> None:
        replies = 0
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                raise ValueError(f"{where}: messages[{i}] needs a role in {ROLES} and a content string")
            add(self.tok.encode(f"<|{m['role']}|>\n"), everything)
            if m["role"] == "assistant":
                replies += 1
                add(self.tok.encode(m["content"]) + eos, True)
                add(self.tok.encode("\n"), everything)
            else:
                add(self.tok.encode(m["content"] + "\n"), everything)
        if not replies:
            raise ValueError(f"{where}: a chat row needs at least one assistant message")
