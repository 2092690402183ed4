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
