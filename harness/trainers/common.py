"""What external trainers' adapters share: the scenario's rows, tokenized once (the same
``Example``s, token ids and the mask of supervised targets, the reference trainer trains on, in
the scenario's order), and LoRA layers put on a model the way mlx-lm does."""

from __future__ import annotations

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


def split_rows(s: Scenario, tok: Any, split: str) -> list[tuple[str, Any]]:
    """The ``split`` ("train" or "eval") rows of the scenario's data, tokenized by ``tok``."""
    from harness.rank.sources import Encoder, row_source

    encode = Encoder(tok, s.data)
    return [(where, encode(where, row)) for where, row in row_source(s.data, s.seed, split)()]


def load_rows(s: Scenario) -> Rows:
    """The train rows, the eval rows (none without ``eval_rows`` or ``eval_path``) and their tokenizer."""
    from harness.rank.tokenizers import load_tokenizer

    tok = load_tokenizer(s.data)
    has_eval = bool(s.data.eval_rows or s.data.eval_path)
    return Rows(split_rows(s, tok, "train"), split_rows(s, tok, "eval") if has_eval else [], tok)


def apply_lora(model: Any, s: Scenario) -> None:
    """Freeze the model and adapt its last ``lora_layers`` blocks (all: -1) with mlx-lm's LoRA.
    mlx-lm draws the LoRA weights from MLX's global RNG, so it is seeded with the scenario seed
    first (the same weights on every rank)."""
    import mlx.core as mx
    from mlx_lm.tuner.utils import linear_to_lora_layers

    mx.random.seed(s.seed)
    t = s.trainer
    model.freeze()
    layers = t.lora_layers if t.lora_layers > 0 else len(model.layers)
    linear_to_lora_layers(model, layers, {"rank": t.lora_rank, "scale": t.lora_scale, "dropout": 0.0})
