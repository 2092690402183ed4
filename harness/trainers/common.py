"""What external trainers' adapters share: the scenario's image rows, encoded as the reference
trainer encodes them (text rows: ``harness.data.rows``), and LoRA layers put on a model the way
mlx-lm does (the split forward of a noise-floor run: ``harness.rank.split_floor``)."""

from __future__ import annotations

from typing import Any

from harness.data.rows import Rows, load_rows
from harness.scenario import Scenario


def load_image_rows(s: Scenario) -> tuple[Rows, Any]:
    """A vision-language scenario's image rows, encoded as the reference trainer encodes them (the
    model's own image processor, its image block in the token ids), and the ``VisionSetup``."""
    from harness.data.images import VisionEncoder, image_row_source
    from harness.data.tokenizers import load_tokenizer
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
