"""Image rows and VLM inputs: generated images match their captions, image tokens match image
features (in rows, in collated batches with and without padding rows), the loss is on the
caption only, and bad image rows name the row."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harness.data.images import COLOURS, VisionEncoder, generated_image, image_row_source
from harness.data.tokenizers import ByteTokenizer
from harness.rank.vision import vision_setup
from harness.scenario import DataSpec, ModelSpec
from harness.trainers.reference.batching import collate

TOK = ByteTokenizer()


def _encoder(arch: str, **data: object) -> VisionEncoder:
    spec = DataSpec(**{"source": "images", **data})
    return VisionEncoder(TOK, spec, vision_setup(ModelSpec(arch=arch), TOK.vocab_size, TOK.pad_id, spec.image_size))


def test_generated_images_show_what_their_captions_say() -> None:
    rng = np.random.default_rng(3)
    for _ in range(20):
        img = generated_image(rng, 90)
        pixels = np.asarray(img.render())
        for d in img.shapes:
            assert d.colour in img.caption() and d.shape in img.caption()
            centre = pixels[int((d.row + 0.5) * 30), int((d.col + 0.5) * 30)]
            assert tuple(centre) == COLOURS[d.colour]  # the shape is drawn in its cell, in its colour
    a = [r["caption"] for _, r in image_row_source(DataSpec(source="images", rows=6), 1)()]
    b = [r["caption"] for _, r in image_row_source(DataSpec(source="images", rows=6), 1)()]
    assert a == b and len(set(a)) > 1  # deterministic per seed, and varied


def test_qwen2_vl_rows_have_one_image_token_per_merged_patch_and_loss_on_the_caption_only() -> None:
    enc = _encoder("qwen2_vl")
    setup = enc.setup
    (where, row), = list(image_row_source(DataSpec(source="images", rows=1), 2)())
    ex = enc(where, row)
    grid = ex.vision["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]] and ex.vision["pixel_values"].shape == (16, 3 * 2 * 14 * 14)
    assert int((ex.ids == setup.image_token).sum()) == 16 // 4
    assert ex.ids[0] == TOK.bos_id and ex.ids[1] == setup.start_token and ex.ids[6] == setup.end_token
    supervised = bytes(int(i) for i, s in zip(ex.ids, ex.supervised, strict=True) if s and i < 256).decode()
    assert supervised == row["caption"] and ex.supervised[-1] and ex.ids[-1] == TOK.eos_id
    assert not ex.supervised[np.isin(ex.ids, setup.block(4))].any()


def test_collated_qwen2_vl_batch_keeps_image_tokens_and_features_aligned_with_padding_rows() -> None:
    enc = _encoder("qwen2_vl")
    rows = [enc(w, r) for w, r in image_row_source(DataSpec(source="images", rows=3), 4)()]
    pad = enc.pad_example()
    assert pad.vision is None and pad.tokens == 0 and not np.isin(pad.ids, enc.setup.block(1)).any()
    b = collate([rows[0], pad, rows[1], rows[2]], TOK.pad_id, vlm=True)
    merged = int(np.prod(b.vision["image_grid_thw"], axis=1).sum()) // 4
    assert b.images == 3 and merged == int((b.inputs == enc.setup.image_token).sum())
    assert b.vision["pixel_values"].shape[0] == merged * 4
    assert b.attention[1].sum() == 1 and b.mask[1].sum() == 0  # the padding row: one real input token, no target
    only_pads = collate([pad, pad], TOK.pad_id, vlm=True)
    assert only_pads.vision is None and only_pads.images == 0 and "pixel_values" not in only_pads.arrays()


def test_dropout_never_drops_image_tokens() -> None:
    enc = _encoder("qwen2_vl")
    rows = [enc(w, r) for w, r in image_row_source(DataSpec(source="images", rows=4), 4)()]
    protect = (enc.setup.image_token, enc.setup.start_token, enc.setup.end_token)
    b = collate(rows, TOK.pad_id, 0.9, [(1, 1, i) for i in range(4)], True, protect)
    plain = collate(rows, TOK.pad_id, vlm=True)
    assert (np.isin(b.inputs, protect) == np.isin(plain.inputs, protect)).all()
    assert (b.inputs == TOK.pad_id).sum() > (plain.inputs == TOK.pad_id).sum() + 50


def test_paligemma_padding_rows_carry_a_blank_image_with_its_tokens() -> None:
    enc = _encoder("paligemma")
    (where, row), = list(image_row_source(DataSpec(source="images", rows=1), 2)())
    ex, pad = enc(where, row), enc.pad_example()
    assert ex.vision["pixel_values"].shape == (1, 3, 56, 56) and ex.ids[16] == TOK.bos_id  # 16 image tokens first
    assert pad.vision["pixel_values"].shape == (1, 3, 56, 56) and pad.tokens == 0
    assert int((pad.ids == enc.setup.image_token).sum()) == 16
    b = collate([ex, pad], TOK.pad_id, vlm=True)
    assert b.images == 2 and b.vision["pixel_values"].shape[0] == 2


def test_local_image_rows_resolve_paths_and_name_bad_rows(tmp_path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (80, 40), (200, 10, 10)).save(tmp_path / "wide.png")
    (tmp_path / "broken.png").write_bytes(b"not an image")
    rows = [{"image": "wide.png", "caption": "a red picture."}, {"image": "missing.png", "caption": "x"},
            {"image": "broken.png", "caption": "x"}, {"image": "wide.png"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = DataSpec(source="jsonl", path=str(tmp_path / "rows.jsonl"), image_size=56)
    enc = _encoder("qwen2_vl", source="jsonl", path=spec.path)
    got = list(image_row_source(spec, 0)())
    ex = enc(*got[0])  # 80 x 40 scaled to fit 56: a 56 x 28 image, a 2 x 4 grid, 2 image tokens
    assert ex.vision["image_grid_thw"].tolist() == [[1, 2, 4]] and enc.token_counts == {2}
    with pytest.raises(ValueError, match=r"rows.jsonl:2: image not found: .*missing.png"):
        enc(*got[1])
    with pytest.raises(ValueError, match=r"rows.jsonl:3: unreadable image .*broken.png"):
        enc(*got[2])
    with pytest.raises(ValueError, match=r"rows.jsonl:4: an image row needs a \"caption\" string or a \"messages\""):
        enc(*got[3])
