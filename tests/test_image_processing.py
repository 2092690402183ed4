"""The numpy + PIL image processors of a VLM rank give what the upstream processors give (mlx-vlm's
Qwen3VLImageProcessor, transformers' SiglipImageProcessorPil, built as the harness built them),
decline the settings they do not implement, and import no transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from harness.rank import image_processing as ip
from harness.rank.vision import _qwen_processor, _siglip_processor

SIZES = [(20, 37), (37, 20), (56, 56), (97, 64), (64, 97), (300, 200)]  # (width, height)


def _images(seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in SIZES]


def _upstream_qwen(model_dir: Path | None, image_size: int) -> Any:
    """The Qwen-VL processor as harness/rank/vision.py built it before the port."""
    from mlx_vlm.models.qwen3_vl import processing_qwen3_vl as qp

    kwargs = qp._qwen_vl_image_kwargs(str(model_dir), default_patch_size=14) if model_dir else {"patch_size": 14}
    factor = int(kwargs["patch_size"]) * int(kwargs.get("merge_size", 2))
    kwargs.setdefault("min_pixels", factor * factor)
    kwargs["max_pixels"] = min(int(kwargs.get("max_pixels", image_size * image_size)), max(image_size, factor) ** 2)
    return qp.Qwen3VLImageProcessor(**kwargs)


def _upstream_siglip(model_dir: Path | None, size: int) -> Any:
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    kwargs: dict[str, Any] = {}
    if model_dir and (model_dir / "preprocessor_config.json").is_file():
        raw = json.loads((model_dir / "preprocessor_config.json").read_text())
        kwargs = {k: raw[k] for k in ("image_mean", "image_std", "rescale_factor") if k in raw}
    return SiglipImageProcessorPil(size={"height": size, "width": size}, **kwargs)


def _model_dir(tmp_path: Path, name: str, pre: dict[str, Any] | None, proc: dict[str, Any] | None = None) -> Path:
    d = tmp_path / name
    d.mkdir()
    if pre is not None:
        (d / "preprocessor_config.json").write_text(json.dumps(pre))
    if proc is not None:
        (d / "processor_config.json").write_text(json.dumps(proc))
    return d


QWEN_DIRS: dict[str, tuple[dict[str, Any] | None, dict[str, Any] | None]] = {
    "empty": (None, None),
    "qwen2_vl": ({"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                  "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                  "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
                  "resample": 3, "do_resize": True}, None),
    "small_bounds": ({"image_mean": [0.1, 0.7, 0.3], "image_std": [0.2, 0.9, 0.45], "min_pixels": 40 * 40,
                      "max_pixels": 3000, "rescale_factor": 0.0041}, None),
    "edges_and_override": ({"size": {"shortest_edge": 5000, "longest_edge": 90000}, "patch_size": 16,
                            "merge_size": 2, "temporal_patch_size": 3},
                           {"image_processor": {"image_mean": [0.2, 0.3, 0.4], "max_pixels": 20000}}),
    "no_rescale_no_normalize": ({"do_rescale": False, "do_normalize": False, "merge_size": 1}, None),
}


@pytest.mark.parametrize("image_size", [56, 224])
@pytest.mark.parametrize("config", [None, *QWEN_DIRS])
def test_qwen_vl_port_matches_mlx_vlm(tmp_path: Path, config: str | None, image_size: int) -> None:
    model_dir = _model_dir(tmp_path, config, *QWEN_DIRS[config]) if config else None
    ours, theirs = _qwen_processor(model_dir, image_size), _upstream_qwen(model_dir, image_size)
    assert isinstance(ours, ip.QwenVLImageProcessor)
    assert ours.merge_size == theirs.merge_size
    for image in _images(image_size):
        a, b = ours(image.convert("RGB")), theirs(image.convert("RGB"))
        assert a["pixel_values"].dtype == b["pixel_values"].dtype == np.float32
        assert a["pixel_values"].shape == b["pixel_values"].shape
        np.testing.assert_allclose(a["pixel_values"], b["pixel_values"], rtol=0, atol=1e-6)
        assert a["image_grid_thw"].dtype == b["image_grid_thw"].dtype
        np.testing.assert_array_equal(a["image_grid_thw"], b["image_grid_thw"])
    batch = _images(1)[:3]
    a, b = ours(batch), theirs(batch)
    np.testing.assert_allclose(a["pixel_values"], b["pixel_values"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(a["image_grid_thw"], b["image_grid_thw"])


SIGLIP_DIRS: dict[str, dict[str, Any] | None] = {
    "no_file": None,
    "paligemma": {"do_convert_rgb": None, "do_normalize": True, "do_rescale": True, "do_resize": True,
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "image_seq_length": 16,
                  "image_processor_type": "SiglipImageProcessor", "resample": 3,
                  "rescale_factor": 0.00392156862745098},
    "other_stats": {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225], "rescale_factor": 0.0045},
    "scalar_stats": {"image_mean": 0.4, "image_std": 0.3},
}


@pytest.mark.parametrize("size", [56, 224])
@pytest.mark.parametrize("config", [None, *SIGLIP_DIRS])
def test_siglip_port_matches_transformers(tmp_path: Path, config: str | None, size: int) -> None:
    model_dir = _model_dir(tmp_path, config, SIGLIP_DIRS[config]) if config else None
    ours, theirs = _siglip_processor(model_dir, size), _upstream_siglip(model_dir, size)
    assert isinstance(ours, ip.SiglipImageProcessor)
    images = [*_images(size), Image.new("RGB", (size, size))]
    for image in images:
        a, b = ours(image.convert("RGB")), theirs(image.convert("RGB"))
        b_pixels = np.asarray(b["pixel_values"])
        assert a["pixel_values"].shape == b_pixels.shape == (1, 3, size, size)
        assert a["pixel_values"].dtype == b_pixels.dtype == np.float32
        np.testing.assert_allclose(a["pixel_values"], b_pixels, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ours(images[:3])["pixel_values"], np.asarray(theirs(images[:3])["pixel_values"]),
                               rtol=0, atol=1e-6)


def test_images_with_transparency_are_composited_like_transformers() -> None:
    rng = np.random.default_rng(5)
    rgba = Image.fromarray(rng.integers(0, 256, (40, 33, 4), dtype=np.uint8))
    ours, theirs = ip.SiglipImageProcessor(56), _upstream_siglip(None, 56)
    np.testing.assert_allclose(ours(rgba)["pixel_values"], np.asarray(theirs(rgba)["pixel_values"]), atol=1e-6)


@pytest.mark.parametrize("pre,proc,why", [
    ({"do_resize": False}, None, "do_resize"),
    ({"resample": 2}, None, "resample"),
    ({"do_center_crop": True}, None, "do_center_crop"),
    ({"size": {"height": 224, "width": 224}}, None, "size['height']"),
    ({"size": {"min_pixels": 100, "max_pixels": 5000}}, None, "size['min_pixels']"),
    ({"image_mean": 0.5}, None, "image_mean"),
    ({"patch_size": 14.0}, None, "patch_size"),
    ({"do_normalize": None}, None, "do_normalize"),
    ({}, {"image_processor": {"do_resize": False}}, "do_resize"),
])
def test_qwen_vl_settings_the_port_does_not_implement_fall_back_to_mlx_vlm(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, pre: dict, proc: dict | None, why: str) -> None:
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor

    d = _model_dir(tmp_path, "m", pre, proc)
    with caplog.at_level("INFO", logger=ip.__name__):
        assert ip.qwen_vl_image_kwargs(d) is None
    assert why in caplog.text and "preprocessor_config.json" in caplog.text
    assert isinstance(_qwen_processor(d, 56), Qwen3VLImageProcessor)


def test_qwen_vl_size_pixel_keys_that_agree_with_the_read_bounds_are_accepted(tmp_path: Path) -> None:
    pre = {"min_pixels": 3136, "max_pixels": 50000, "size": {"min_pixels": 3136, "max_pixels": 50000}}
    assert ip.qwen_vl_image_kwargs(_model_dir(tmp_path, "m", pre)) == {"patch_size": 14, "min_pixels": 3136,
                                                                        "max_pixels": 50000}


@pytest.mark.parametrize("pre", [
    {"do_resize": False}, {"resample": 0}, {"do_normalize": False}, {"do_rescale": False}, {"do_pad": True},
    {"size": {"height": 224, "width": 224}}, {"size": {"shortest_edge": 56}}, {"image_mean": [0.5, 0.5]},
])
def test_siglip_settings_the_port_does_not_implement_fall_back_to_transformers(tmp_path: Path, pre: dict) -> None:
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    d = _model_dir(tmp_path, "m", pre)
    assert ip.siglip_image_kwargs(d, 56) is None
    if "image_mean" not in pre:  # transformers itself rejects a mean of two values for RGB, at call time
        assert isinstance(_siglip_processor(d, 56), SiglipImageProcessorPil)


def test_the_default_processors_import_no_transformers() -> None:
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from PIL import Image\n"
        "from harness.rank.vision import _qwen_processor, _siglip_processor\n"
        "q, s = _qwen_processor(None, 56), _siglip_processor(None, 56)\n"
        "out = q(Image.new('RGB', (56, 56)).convert('RGB'))\n"
        "assert out['pixel_values'].shape == (16, 3 * 2 * 14 * 14), out['pixel_values'].shape\n"
        "assert out['image_grid_thw'].tolist() == [[1, 4, 4]] and q.merge_size == 2\n"
        "assert s(Image.new('RGB', (30, 20)))['pixel_values'].shape == (1, 3, 56, 56)\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
        "assert 'mlx_vlm.models.qwen3_vl.processing_qwen3_vl' not in sys.modules, 'mlx-vlm processor imported'\n"
        "assert 'torch' not in sys.modules\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0, p.stderr[-2000:]
