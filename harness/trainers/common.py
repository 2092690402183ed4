"""What external trainers' adapters share: the scenario's rows, tokenized once (the same
``Example``s, token ids and the mask of supervised targets, the reference trainer trains on, in
the scenario's order), and LoRA layers put on a model the way mlx-lm does."""

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
    from harness.rank.sources import Encoder, row_source

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
    from harness.rank.tokenizers import load_tokenizer

    tok = tok or load_tokenizer(s.data)
    has_eval = bool(s.data.eval_rows or s.data.eval_path)
    return Rows(split_rows(s, tok, "train", encode, source) if train else [],
                split_rows(s, tok, "eval", encode, source) if has_eval else [], tok)


def load_image_rows(s: Scenario) -> tuple[Rows, Any]:
    """A vision-language scenario's image rows, encoded as the reference trainer encodes them (the
    model's own image processor, its image block in the token ids), and the ``VisionSetup``."""
    from harness.rank.images import VisionEncoder, image_row_source
    from harness.rank.tokenizers import load_tokenizer
    from harness.rank.vision import vision_setup

    tok = load_tokenizer(s.data)
    vision = vision_setup(s.model, tok.vocab_size, tok.pad_id, s.data.image_size)
    return load_rows(s, VisionEncoder(tok, s.data, vision), image_row_source, tok), vision


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


def chunk_rows(rows: int, n: int) -> list[list[int]]:
    """``n`` contiguous chunks of ``rows`` rows (sizes differ by at most one; none empty), each
    listed in reverse order."""
    n = max(1, min(n, rows))
    cuts = [rows * k // n for k in range(n + 1)]
    return [list(range(stop - 1, start - 1, -1)) for start, stop in zip(cuts[:-1], cuts[1:], strict=True)]


def take_rows(args: tuple[Any, ...], kwargs: dict[str, Any], rows: int, picked: list[int]
              ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A forward call's arguments for the ``picked`` rows, in that order: every array with
    ``rows`` rows is indexed."""
    import mlx.core as mx

    at = mx.array(picked)

    def cut(v: Any) -> Any:
        return v[at] if isinstance(v, mx.array) and v.ndim and v.shape[0] == rows else v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def split_forward(model: Any, n: int, take: Any = take_rows) -> None:
    """The floor run of an external trainer: the model's forward computes each batch in ``n``
    contiguous chunks of rows, each with its rows in reverse order (the shapes of ``n`` ranks'
    batches, the gradient summed from ``n`` partial products as ``n`` ranks sum it, and another
    summation order inside each), and returns the logits of every row in the original order: the
    same mathematics as one forward on the whole batch, only its rounding differs. ``take(args,
    kwargs, rows, picked)`` cuts a call's arguments. The class is swapped, so the parameter tree
    keeps its names."""
    import mlx.core as mx

    base = type(model)

    def call(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        rows = inputs.shape[0]
        outs = []
        for picked in chunk_rows(rows, n):
            a, kw = take((inputs, *args), kwargs, rows, picked)
            out = base.__call__(self, *a, **kw)
            outs.append(getattr(out, "logits", out)[::-1])
        return mx.concatenate(outs, axis=0)

    model.__class__ = type(f"Split{base.__name__}", (base,), {"__call__": call})


def split_text_model(model: Any, n: int) -> Any:
    """``split_forward`` on a text model's transformer body (``model.model`` in mlx-lm's models),
    so that trainers which compute their loss from the hidden states (a fused cross-entropy that
    never calls the whole model) are split too; returns ``model``."""
    split_forward(getattr(model, "model", model), n)
    return model
