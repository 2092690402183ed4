"""A scenario's rows, tokenized once: the same ``Example``s (token ids and the mask of supervised
targets) the reference trainer trains on, in the scenario's order, for every trainer and for the
checks made before a launch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from harness.scenario import Scenario


@dataclass
class Rows:
    """Train and eval rows as ``(where, Example)`` pairs, and the tokenizer that made them."""

    train: list[tuple[str, Any]]
    eval: list[tuple[str, Any]]
    tokenizer: Any

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)


def iter_rows(s: Scenario, tok: Any, split: str, encode: Any = None, source: Any = None) -> Iterator[tuple[str, Any]]:
    """The ``split`` ("train" or "eval") rows of the scenario's data, read and encoded one at a
    time by ``encode`` (the text ``Encoder`` of ``tok`` unless given) from ``source`` (its row
    source unless given)."""
    from harness.data.sources import Encoder, row_source

    encode = encode or Encoder(tok, s.data)
    for where, row in (source or row_source)(s.data, s.seed, split)():
        yield where, encode(where, row)


def split_rows(s: Scenario, tok: Any, split: str, encode: Any = None, source: Any = None) -> list[tuple[str, Any]]:
    """``iter_rows``, all of them."""
    return list(iter_rows(s, tok, split, encode, source))


def load_rows(s: Scenario, encode: Any = None, source: Any = None, tok: Any = None, train: bool = True) -> Rows:
    """The train rows (none unless ``train``: a trainer that reads them lazily), the eval rows
    (none without ``eval_rows`` or ``eval_path``) and their tokenizer (``tok``, else the
    scenario's), encoded as ``split_rows`` encodes them."""
    from harness.data.tokenizers import load_tokenizer

    tok = tok or load_tokenizer(s.data)
    has_eval = bool(s.data.eval_rows or s.data.eval_path)
    return Rows(split_rows(s, tok, "train", encode, source) if train else [],
                split_rows(s, tok, "eval", encode, source) if has_eval else [], tok)
