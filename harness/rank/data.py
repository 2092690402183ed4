"""Training rows, tokenizers, global batches and rank sharding.

Every rank builds the same global batch plan from the scenario seed (a local numpy Generator;
the global numpy and MLX RNGs are never touched), then keeps only its share: rank r takes rows
r, r+N, ... of each global batch. Global batches are cut per epoch; a short last batch is padded
by repeating real rows from the start of the epoch, so every rank runs the same number of steps
and the plan does not depend on the world size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from harness.scenario import DataSpec

COLORS = ("red", "green", "blue", "yellow", "black", "white", "purple", "orange")
ANIMALS = ("cat", "dog", "fox", "owl", "bee", "cow", "hen", "eel")
VERBS = ("sees", "likes", "chases", "finds", "hears", "meets")
PLACES = ("the barn", "the hill", "the river", "the wood", "the town")


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...


@dataclass
class ByteTokenizer:
    """UTF-8 bytes 0-255, then pad, bos and eos."""

    vocab_size: int = 259
    pad_id: int = 256
    bos_id: int | None = 257
    eos_id: int | None = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class FileTokenizer:
    """A local ``tokenizer.json`` read with the Hugging Face ``tokenizers`` package."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"{path}: not a usable tokenizer.json ({e})") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

        def tid(*names: str) -> int | None:
            for n in names:
                i = self._tok.token_to_id(n)
                if i is not None:
                    return i
            return None

        self.bos_id = tid("<s>", "<|begin_of_text|>", "<bos>", "<|endoftext|>")
        self.eos_id = tid("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>", "<|im_end|>")
        pad = tid("<pad>", "<|pad|>", "[PAD]")
        if pad is None:
            pad = self.eos_id if self.eos_id is not None else 0
        self.pad_id = pad

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def load_tokenizer(spec: DataSpec) -> Tokenizer:
    return ByteTokenizer() if spec.tokenizer == "byte" else FileTokenizer(spec.tokenizer)


def generated_text(rng: np.random.Generator, min_chars: int, max_chars: int) -> str:
    """One row of a small grammar: the loss falls as a model learns its words and structure."""
    target = int(rng.integers(min_chars, max_chars + 1))
    parts: list[str] = []
    while sum(len(p) + 1 for p in parts) < target:
        c1, c2 = rng.choice(COLORS, 2)
        a1, a2 = rng.choice(ANIMALS, 2)
        verb, place = rng.choice(VERBS), rng.choice(PLACES)
        n = int(rng.integers(1, 9))
        parts.append(f"the {c1} {a1} {verb} the {c2} {a2} in {place}, {n}+{n}={2 * n}.")
    return " ".join(parts)[:target]


def load_texts(spec: DataSpec, seed: int) -> list[str]:
    """The dataset's rows, identical on every rank."""
    if spec.source == "generated":
        rng = np.random.default_rng([seed, 1])
        return [generated_text(rng, spec.min_chars, spec.max_chars) for _ in range(spec.rows)]
    texts = []
    path = Path(str(spec.path))
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from e
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f'{path}:{n}: expected an object with a "text" string')
            texts.append(row["text"])
    if not texts:
        raise ValueError(f"{path}: no rows")
    return texts[: spec.rows]


def tokenize(texts: list[str], tok: Tokenizer, max_seq_len: int) -> list[list[int]]:
    """bos + tokens + eos, cut to ``max_seq_len``; rows under two tokens are refused."""
    rows = []
    for i, t in enumerate(texts):
        ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(t)
        ids += [tok.eos_id] if tok.eos_id is not None else []
        ids = ids[:max_seq_len]
        if len(ids) < 2:
            raise ValueError(f"row {i} has fewer than two tokens")
        rows.append(ids)
    return rows


def global_batches(n_rows: int, global_batch: int, steps: int) -> list[list[int]]:
    """Row indices of each optimizer step's global batch (ordered, padded per epoch)."""
    per_epoch = []
    order = list(range(n_rows))
    for start in range(0, n_rows, global_batch):
        batch = order[start : start + global_batch]
        pad = 0
        while len(batch) < global_batch:  # repeat real rows from the epoch's start
            batch.append(order[pad % n_rows])
            pad += 1
        per_epoch.append(batch)
    return [per_epoch[s % len(per_epoch)] for s in range(steps)]


def shard(batch: list[int], rank: int, world_size: int) -> list[int]:
    """This rank's rows of a global batch: positions rank, rank+N, ..."""
    return batch[rank::world_size]


@dataclass
class LocalBatch:
    """Inputs, targets and a loss mask of one rank's rows, padded to the longest of them."""

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


def collate(rows: list[list[int]], pad_id: int) -> LocalBatch:
    width = max(len(r) for r in rows) - 1
    inputs = np.full((len(rows), width), pad_id, dtype=np.int32)
    targets = np.full((len(rows), width), pad_id, dtype=np.int32)
    mask = np.zeros((len(rows), width), dtype=np.float32)
    for i, r in enumerate(rows):
        n = len(r) - 1
        inputs[i, :n] = r[:-1]
        targets[i, :n] = r[1:]
        mask[i, :n] = 1.0
    return LocalBatch(inputs, targets, mask)
