"""Image rows for vision-language models, and how a row becomes token ids plus vision inputs.

Sources: a built-in generator of real images drawn with Pillow (shapes with colours, sizes and
positions, and a caption that describes them, so the loss falls as the model learns to look), or
local JSONL rows ``{"image": path, "caption": str}`` / ``{"image": path, "messages": [...]}``
with image paths relative to the JSONL file. Generated rows are drawn only when a rank encodes
them, so a rank pays for its own share only.

The loss covers the caption (or the assistant's replies) only; image tokens are never targets.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from harness.data.sources import Encoder, Example, Row, RowSource, empty_example, jsonl_rows, row_source
from harness.data.tokenizers import Tokenizer
from harness.scenario import DataSpec

SHAPES = ("circle", "square", "triangle", "diamond")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (240, 210, 40),
           "purple": (140, 60, 180), "orange": (245, 140, 30), "black": (20, 20, 20)}
ROWS_AT, COLS_AT = ("top", "middle", "bottom"), ("left", "center", "right")
SIZES = {"small": 0.18, "large": 0.32}
IMAGE_EVAL_STREAM = 6


@dataclass(frozen=True)
class Drawn:
    """One shape: what it is, its colour, its size and its cell in a 3 x 3 grid."""

    shape: str
    colour: str
    size: str
    row: int
    col: int

    def words(self) -> str:
        where = "the center" if (self.row, self.col) == (1, 1) else f"the {ROWS_AT[self.row]} {COLS_AT[self.col]}"
        return f"a {self.size} {self.colour} {self.shape} at {where}"


@dataclass(frozen=True)
class DrawnImage:
    """A generated image, drawn on demand (``render``) from its shapes."""

    shapes: tuple[Drawn, ...]
    size: int

    def caption(self) -> str:
        return " and ".join(d.words() for d in self.shapes) + "."

    def render(self) -> Any:
        from PIL import Image, ImageDraw

        img = Image.new("RGB", (self.size, self.size), (255, 255, 255))
        draw = ImageDraw.Draw(img)
        cell = self.size / 3
        for d in self.shapes:
            cx, cy, r = (d.col + 0.5) * cell, (d.row + 0.5) * cell, SIZES[d.size] * self.size
            box = [cx - r, cy - r, cx + r, cy + r]
            fill = COLOURS[d.colour]
            if d.shape == "circle":
                draw.ellipse(box, fill=fill)
            elif d.shape == "square":
                draw.rectangle(box, fill=fill)
            elif d.shape == "triangle":
                draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
            else:
                draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
        return img


def generated_image(rng: np.random.Generator, size: int) -> DrawnImage:
    """One or two shapes in different cells (captions of different lengths)."""
    cells = rng.permutation(9)[: int(rng.integers(1, 3))]
    shapes = tuple(
        Drawn(str(rng.choice(SHAPES)), str(rng.choice(list(COLOURS))), str(rng.choice(list(SIZES))),
              int(c) // 3, int(c) % 3)
        for c in cells
    )
    return DrawnImage(shapes, size)


def local_image_rows(path: Path, limit: int | None) -> Iterator[tuple[str, Row]]:
    """JSONL image rows with their image path resolved against the JSONL file's folder."""
    for where, row in jsonl_rows(path, limit):
        if isinstance(row, dict) and isinstance(row.get("image"), str):
            try:
                row = {**row, "image": str((path.parent / row["image"]).resolve())}
            except (ValueError, OSError) as e:  # a NUL byte, a symlink loop
                raise ValueError(f"{where}: \"image\" is not a usable path: {row['image']!r} ({e})") from e
        yield where, row


def image_row_source(spec: DataSpec, seed: int, split: str = "train") -> RowSource:
    """A re-openable source of image rows (generated, or the JSONL file of the split)."""

    def make(rng: np.random.Generator) -> Row:
        image = generated_image(rng, spec.image_size)
        return {"image": image, "caption": image.caption()}

    return row_source(spec, seed, split, local_image_rows, make, IMAGE_EVAL_STREAM)


def open_image(where: str, image: Any, max_side: int) -> Any:
    """A PIL image from a row's ``image`` (a generated image or a path), scaled to fit ``max_side``."""
    if isinstance(image, DrawnImage):
        return image.render()
    if not isinstance(image, str):
        raise ValueError(f"{where}: \"image\" must be a path string, got {str(image)[:60]}")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(image) as f:
            img = f.convert("RGB")
    except FileNotFoundError as e:
        raise ValueError(f"{where}: image not found: {image}") from e
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{where}: unreadable image {image} ({e})") from e
    if max(img.size) > max_side:
        img.thumbnail((max_side, max_side))
    return img


def image_text_row(where: str, row: Any) -> Row:
    """The text part of an image row: a caption row as a prompt/completion row whose completion
    is the caption, a chat row's messages as they are (ValueError naming ``where`` otherwise)."""
    if not isinstance(row, dict) or "image" not in row:
        raise ValueError(f"{where}: an image row needs \"image\" and a \"caption\" or \"messages\"")
    if isinstance(row.get("caption"), str):
        prompt = row.get("prompt", "")
        if not isinstance(prompt, str):
            raise ValueError(f"{where}: an image row's \"prompt\" must be a string")
        return {"prompt": prompt, "completion": row["caption"]}
    if isinstance(row.get("messages"), list):
        return {"messages": row["messages"]}
    raise ValueError(f"{where}: an image row needs a \"caption\" string or a \"messages\" list")


class VisionEncoder:
    """Image rows -> ``Example``s: the model's image block, then the text as ``Encoder`` makes it.

    A caption row is a prompt/completion row whose completion is the caption (the loss is on the
    caption); a chat row keeps its messages. Truncation to ``max_seq_len`` never cuts the image
    block, so image tokens and image features always match.
    """

    def __init__(self, tok: Tokenizer, spec: DataSpec, setup: Any):  # a harness.rank.vision.VisionSetup
        self.setup, self.max_len, self.image_size = setup, spec.max_seq_len, spec.image_size
        self.text = Encoder(tok, replace(spec, max_seq_len=1 << 30))
        self.pad_id, self.bos = tok.pad_id, tok.bos_id is not None
        self.token_counts: set[int] = set()  # image tokens per encoded image: one value per patch grid
        self._pad: Example | None = None

    def __call__(self, where: str, row: Any) -> Example:
        text_row = image_text_row(where, row)
        vision = self.setup.process(open_image(where, row["image"], self.image_size))
        count = self.setup.image_tokens(vision)
        self.token_counts.add(count)
        block = self.setup.block(count)
        text = self.text(where, text_row)
        keep = self.max_len - len(block)
        if keep < 2:
            raise ValueError(f"{where}: the image takes {len(block)} tokens, max_seq_len is {self.max_len}")
        return self._assemble(block, text.ids[:keep], text.supervised[:keep], vision)

    def _assemble(self, block: list[int], ids: np.ndarray, sup: np.ndarray, vision: dict[str, np.ndarray] | None
                  ) -> Example:
        at = 0 if self.setup.image_first or not self.bos else 1  # after bos (Qwen-VL), before it (PaliGemma)
        ids = np.concatenate([ids[:at], np.array(block, dtype=np.int32), ids[at:]]).astype(np.int32)
        sup = np.concatenate([sup[:at], np.zeros(len(block), dtype=bool), sup[at:]])
        return Example(ids, sup, vision)

    def pad_example(self) -> Example:
        """A padding row: zero supervised tokens, and neutral vision inputs (none, or a blank
        image with its image tokens when the family needs one image per row). Made once."""
        if self._pad is None:
            self._pad = empty_example(self.pad_id)
            if self.setup.image_per_row:
                vision = self.setup.blank()
                block = self.setup.block(self.setup.image_tokens(vision))
                self._pad = self._assemble(block, self._pad.ids, self._pad.supervised, vision)
        return self._pad
