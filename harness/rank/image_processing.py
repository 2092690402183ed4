"""Image preprocessing of the VLM families, in numpy and PIL only (no transformers, no torch).

Two processors give what the upstream ones give for the settings a VLM rank uses:

* ``QwenVLImageProcessor``: mlx-vlm's ``Qwen3VLImageProcessor`` (Qwen2/3-VL): the image is resized
  (PIL bicubic) to multiples of ``patch_size * merge_size`` within ``min_pixels``/``max_pixels``,
  rescaled, normalized, repeated ``temporal_patch_size`` times and cut into flattened patches,
  ordered so that each ``merge_size x merge_size`` block of patches is contiguous.
* ``SiglipImageProcessor``: transformers' ``SiglipImageProcessorPil`` (PaliGemma): a resize
  (PIL bicubic) to ``size x size``, rescale, normalize, channels first, with a batch dimension.

``qwen_vl_image_kwargs`` and ``siglip_image_kwargs`` read a local model directory's
preprocessing settings the way the harness read them for the upstream processors. They return
None when the directory holds a setting these ports do not implement (``do_resize: false``, another
``resample``, a center crop, padding, an unexpected ``size`` or a value of an unexpected type):
the caller then uses the upstream processor, so such a directory is processed exactly as before.
The reason is logged (``logging``, level INFO) under this module's name.
"""

from __future__ import annotations

import json
import logging
import math
from numbers import Real
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
HALF = (0.5, 0.5, 0.5)  # the default mean and std of both families


class Unsupported(ValueError):
    """A preprocessing setting of a model directory that these ports do not implement."""


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise Unsupported(f"{path}: not a JSON object")
    return raw


def _is_number(v: Any) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def _triple(v: Any, where: str, scalar_ok: bool) -> tuple[float, float, float]:
    if scalar_ok and _is_number(v):
        return (float(v),) * 3
    if isinstance(v, (list, tuple)) and len(v) == 3 and all(_is_number(x) for x in v):
        return tuple(float(x) for x in v)  # type: ignore[return-value]
    raise Unsupported(f"{where}: expected three numbers, got {v!r}")


def _check_neutral(raw: dict[str, Any], where: str) -> None:
    """Settings neither the ports nor the harness's use of the upstream processors act on: only
    their default values are accepted."""
    if raw.get("do_resize", True) is not True:
        raise Unsupported(f"{where}: do_resize {raw['do_resize']!r} (only true is implemented)")
    if raw.get("resample") not in (None, BICUBIC):
        raise Unsupported(f"{where}: resample {raw['resample']!r} (only {BICUBIC}, bicubic, is implemented)")
    for key in ("do_center_crop", "do_pad"):
        if raw.get(key):
            raise Unsupported(f"{where}: {key} {raw[key]!r} (not implemented)")


def _rgb_array(image: Any, composite_alpha: bool) -> np.ndarray:
    """``(H, W, 3)`` uint8 pixels of a PIL image (transparency over white when ``composite_alpha``)."""
    from PIL import Image

    if composite_alpha and ("A" in image.getbands() or image.info.get("transparency") is not None):
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return np.asarray(image.convert("RGB"))


def _resize(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    from PIL import Image

    if pixels.shape[:2] == (height, width):
        return pixels
    return np.asarray(Image.fromarray(pixels).resize((width, height), resample=BICUBIC))


def smart_resize(height: int, width: int, factor: int, min_pixels: float, max_pixels: float) -> tuple[int, int]:
    """Qwen-VL's target size: both sides multiples of ``factor``, the area within the pixel bounds,
    the aspect ratio kept as nearly as the rounding allows."""
    if (ratio := max(height, width) / min(height, width)) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * scale / factor) * factor, math.ceil(width * scale / factor) * factor
    return h, w


class QwenVLImageProcessor:
    """Qwen2/3-VL images to ``pixel_values`` ``(patches, 3 * temporal_patch_size * patch_size**2)``
    and ``image_grid_thw`` ``(images, 3)``, as mlx-vlm's ``Qwen3VLImageProcessor`` makes them."""

    def __init__(self, patch_size: int = 16, temporal_patch_size: int = 2, merge_size: int = 2,
                 min_pixels: float = 56 * 56, max_pixels: float = 14 * 14 * 4 * 1280, do_rescale: bool = True,
                 rescale_factor: float = 1 / 255, do_normalize: bool = True, image_mean: Any = None,
                 image_std: Any = None, do_convert_rgb: bool = True) -> None:
        self.patch_size, self.temporal_patch_size, self.merge_size = patch_size, temporal_patch_size, merge_size
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.do_rescale, self.rescale_factor, self.do_normalize = do_rescale, rescale_factor, do_normalize
        self.image_mean, self.image_std = image_mean or list(HALF), image_std or list(HALF)
        self.do_convert_rgb = do_convert_rgb  # as upstream: images are always converted to RGB

    def _one(self, image: Any) -> tuple[np.ndarray, list[int]]:
        pixels = _rgb_array(image, composite_alpha=False)
        ps, ms, tps = self.patch_size, self.merge_size, self.temporal_patch_size
        h, w = smart_resize(*pixels.shape[:2], ps * ms, self.min_pixels, self.max_pixels)
        x = _resize(pixels, h, w).transpose(2, 0, 1).astype(np.float32)  # (C, H, W)
        if self.do_rescale:
            x = x * self.rescale_factor
        if self.do_normalize:
            x = (x - np.array(self.image_mean, np.float32)[:, None, None]) / np.array(self.image_std, np.float32)[
                :, None, None]
        c, gh, gw = x.shape[0], h // ps, w // ps
        # (C, H, W) -> merge blocks (gh/ms, gw/ms), patches within a block (ms, ms), then C, T, ps, ps
        x = x.reshape(c, gh // ms, ms, ps, gw // ms, ms, ps).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tps, ps, ps))
        return x.reshape(gh * gw, c * tps * ps * ps), [1, gh, gw]

    def __call__(self, images: Any) -> dict[str, np.ndarray]:
        done = [self._one(im) for im in (images if isinstance(images, (list, tuple)) else [images])]
        return {"pixel_values": np.concatenate([p for p, _ in done]),
                "image_grid_thw": np.array([g for _, g in done], dtype=np.int64)}


class SiglipImageProcessor:
    """SigLIP (PaliGemma) images to ``pixel_values`` ``(images, 3, size, size)``, as transformers'
    ``SiglipImageProcessorPil(size={"height": size, "width": size}, ...)`` makes them."""

    def __init__(self, size: int, image_mean: Any = None, image_std: Any = None,
                 rescale_factor: float | None = None) -> None:
        self.size = size
        self.image_mean = np.array(image_mean if image_mean is not None else HALF, np.float32)
        self.image_std = np.array(image_std if image_std is not None else HALF, np.float32)
        self.rescale_factor = 1 / 255 if rescale_factor is None else rescale_factor

    def _one(self, image: Any) -> np.ndarray:
        x = _resize(_rgb_array(image, composite_alpha=True), self.size, self.size).transpose(2, 0, 1)
        x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        return (x - self.image_mean[:, None, None]) / self.image_std[:, None, None]

    def __call__(self, images: Any) -> dict[str, np.ndarray]:
        return {"pixel_values": np.stack([self._one(im) for im in
                                          (images if isinstance(images, (list, tuple)) else [images])])}


def _declined(model_dir: Path, e: Unsupported) -> None:
    log.info("%s: the upstream image processor is used: %s", model_dir, e)


def qwen_vl_image_kwargs(model_dir: Path | str, default_patch_size: int = 14) -> dict[str, Any] | None:
    """``QwenVLImageProcessor`` kwargs from a local directory's ``preprocessor_config.json``, updated
    by ``processor_config.json``'s ``image_processor`` (the files and keys mlx-vlm reads), or None
    where it holds a setting the port does not implement."""
    model_dir = Path(model_dir)
    try:
        return _qwen_kwargs(model_dir, default_patch_size)
    except Unsupported as e:
        _declined(model_dir, e)
        return None


def _qwen_kwargs(model_dir: Path, default_patch_size: int) -> dict[str, Any]:
    where = f"{model_dir / 'preprocessor_config.json'} (+ processor_config.json's image_processor)"
    raw = _load(model_dir / "preprocessor_config.json")
    override = _load(model_dir / "processor_config.json").get("image_processor") or {}
    if not isinstance(override, dict):
        raise Unsupported(f"{model_dir / 'processor_config.json'}: image_processor is not an object")
    raw.update(override)
    _check_neutral(raw, where)
    out: dict[str, Any] = {"patch_size": default_patch_size}
    for key in ("patch_size", "temporal_patch_size", "merge_size"):
        if key in raw:
            if not isinstance(raw[key], int) or isinstance(raw[key], bool) or raw[key] < 1:
                raise Unsupported(f"{where}: {key} {raw[key]!r} is not a positive integer")
            out[key] = raw[key]
    for key in ("image_mean", "image_std"):
        if raw.get(key):  # upstream: a missing, null or empty value means 0.5
            out[key] = list(_triple(raw[key], f"{where}: {key}", scalar_ok=False))
    for key in ("do_rescale", "do_normalize"):
        if key in raw and not isinstance(raw[key], bool):
            raise Unsupported(f"{where}: {key} {raw[key]!r} is not true or false")
    if "rescale_factor" in raw and not _is_number(raw["rescale_factor"]):
        raise Unsupported(f"{where}: rescale_factor {raw['rescale_factor']!r} is not a number")
    out.update({k: raw[k] for k in ("rescale_factor", "do_rescale", "do_normalize", "do_convert_rgb") if k in raw})
    size = raw.get("size") or {}
    if not isinstance(size, dict):
        raise Unsupported(f"{where}: size {size!r} is not an object")
    for key, target in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels"),
                        ("min_pixels", "min_pixels"), ("max_pixels", "max_pixels")):
        source = size if key.endswith("_edge") else raw
        if source.get(key) is not None:
            if not _is_number(source[key]) or source[key] <= 0:
                raise Unsupported(f"{where}: {key} {source[key]!r} is not a positive number")
            out[target] = source[key]
    for key, value in size.items():  # mlx-vlm reads only the *_edge keys of size
        if key not in ("shortest_edge", "longest_edge") and not (key in ("min_pixels", "max_pixels")
                                                                  and value == out.get(key)):
            raise Unsupported(f"{where}: size[{key!r}] {value!r} (not read by the Qwen-VL processor)")
    return out


def siglip_image_kwargs(model_dir: Path | str | None, size: int) -> dict[str, Any] | None:
    """``SiglipImageProcessor`` kwargs for ``size``: ``image_mean``, ``image_std`` and
    ``rescale_factor`` of a local directory's ``preprocessor_config.json`` (or the defaults), or
    None where that file holds a setting the port does not implement."""
    out: dict[str, Any] = {"size": size}
    if model_dir is None:
        return out
    path = Path(model_dir) / "preprocessor_config.json"
    try:
        raw = _load(path)
        _check_neutral(raw, str(path))
        for key in ("do_rescale", "do_normalize"):
            if raw.get(key, True) is not True:
                raise Unsupported(f"{path}: {key} {raw[key]!r} (only true is implemented)")
        want = {"height": size, "width": size}
        if raw.get("size") is not None and raw["size"] != want:
            raise Unsupported(f"{path}: size {raw['size']!r} is not the model's {want}")
        for key in ("image_mean", "image_std"):
            if raw.get(key) is not None:
                out[key] = _triple(raw[key], f"{path}: {key}", scalar_ok=True)
        if raw.get("rescale_factor") is not None:
            if not _is_number(raw["rescale_factor"]):
                raise Unsupported(f"{path}: rescale_factor {raw['rescale_factor']!r} is not a number")
            out["rescale_factor"] = raw["rescale_factor"]
    except Unsupported as e:
        _declined(Path(model_dir), e)
        return None
    return out
