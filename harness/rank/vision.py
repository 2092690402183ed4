"""Vision-language models: mlx-vlm architectures, their own image preprocessing and token layout.

A ``VisionSetup`` ties a model to its data: the model config (a tiny default with the
scenario's overrides, or a local model directory's ``config.json``), the ids of its image tokens,
the image processor of the model family (numpy + PIL ports of mlx-vlm's Qwen-VL processor and
transformers' SigLIP processor for PaliGemma, in ``harness.rank.image_processing``, with no
transformers import; the upstream processor only where a model directory's preprocessing config
holds a setting the port does not implement), and where the image block goes in a row's token ids.

Families differ in how a row without an image looks: Qwen2-VL takes rows with no image (no image
tokens, no patches), PaliGemma needs one image per row, so its padding rows carry a blank image
with its image tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.rank.weights import import_model_module, placeholder_init, seeded_init
from harness.scenario import ModelSpec

TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "rope_theta": 10000.0}
TINY_VLM: dict[str, dict[str, Any]] = {
    "qwen2_vl": {
        **TEXT, "num_key_value_heads": 2, "tie_word_embeddings": True,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 2, 2]},
        "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2.0,
                          "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    },
    "paligemma": {
        "hidden_size": 64, "projection_dim": 64,
        "text_config": {**TEXT, "model_type": "gemma", "num_key_value_heads": 1, "head_dim": 16},
        "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 2, "hidden_size": 32,
                          "intermediate_size": 64, "num_attention_heads": 2, "patch_size": 14, "image_size": 56,
                          "projection_dim": 64},
    },
}
# Generation-time caches some language models keep on themselves; a training forward must not reuse them.
GENERATION_CACHES = ("_position_ids", "_rope_deltas")


@dataclass
class VisionSetup:
    """What the data side and the model side of a VLM must agree on."""

    arch: str
    config: dict[str, Any]
    image_token: int
    start_token: int | None  # tokens around the image tokens (Qwen-VL), or None
    end_token: int | None
    processor: Any
    image_per_row: bool  # every row carries exactly one image (padding rows a blank one)
    image_first: bool  # the image block comes before the bos token (PaliGemma)
    image_size: int

    def process(self, image: Any) -> dict[str, np.ndarray]:
        """The model's inputs for one PIL image: ``pixel_values`` (+ ``image_grid_thw`` for Qwen-VL)."""
        out = self.processor(image.convert("RGB"))
        vision = {"pixel_values": np.asarray(out["pixel_values"], dtype=np.float32)}
        if "image_grid_thw" in out:
            vision["image_grid_thw"] = np.asarray(out["image_grid_thw"], dtype=np.int32)
        return vision

    def image_tokens(self, vision: dict[str, np.ndarray]) -> int:
        """How many image tokens the text needs for these features (the processor's own rule)."""
        if "image_grid_thw" in vision:
            merge = int(self.processor.merge_size)
            return int(np.prod(vision["image_grid_thw"], axis=1).sum()) // (merge * merge)
        return int(self.config["text_config"]["num_image_tokens"])

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The ids an image block is made of (never dropped, never targets)."""
        return tuple(t for t in (self.start_token, self.image_token, self.end_token) if t is not None)

    def block(self, count: int) -> list[int]:
        ends = [t for t in (self.start_token, self.end_token) if t is not None]
        return ends[:1] + [self.image_token] * count + ends[1:]

    def blank(self) -> dict[str, np.ndarray]:
        """Neutral vision inputs for a padding row of a one-image-per-row family: a blank image."""
        from PIL import Image

        return self.process(Image.new("RGB", (self.image_size, self.image_size)))


def _qwen_processor(model_dir: Path | None, image_size: int) -> Any:
    from harness.rank import image_processing as ip

    kwargs = ip.qwen_vl_image_kwargs(model_dir, default_patch_size=14) if model_dir else {"patch_size": 14}
    processor: Any = ip.QwenVLImageProcessor
    if kwargs is None:  # a setting the port does not implement: mlx-vlm's processor, as read by mlx-vlm
        from mlx_vlm.models.qwen3_vl import processing_qwen3_vl as qp

        kwargs, processor = qp._qwen_vl_image_kwargs(str(model_dir), default_patch_size=14), qp.Qwen3VLImageProcessor
    factor = int(kwargs["patch_size"]) * int(kwargs.get("merge_size", 2))
    kwargs.setdefault("min_pixels", factor * factor)
    kwargs["max_pixels"] = min(int(kwargs.get("max_pixels", image_size * image_size)), max(image_size, factor) ** 2)
    return processor(**kwargs)


def _siglip_processor(model_dir: Path | None, size: int) -> Any:
    from harness.rank import image_processing as ip

    fast = ip.siglip_image_kwargs(model_dir, size)
    if fast is not None:
        return ip.SiglipImageProcessor(**fast)
    # a setting the port does not implement: transformers' processor, built as before
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    kwargs: dict[str, Any] = {}
    if model_dir and (model_dir / "preprocessor_config.json").is_file():
        raw = json.loads((model_dir / "preprocessor_config.json").read_text())
        kwargs = {k: raw[k] for k in ("image_mean", "image_std", "rescale_factor") if k in raw}
    return SiglipImageProcessorPil(size={"height": size, "width": size}, **kwargs)


def _read_config(path: Path) -> dict[str, Any]:
    f = path / "config.json"
    if not f.is_file():
        raise ValueError(f"{f}: not found (a model directory needs config.json)")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not JSON ({e.msg})") from e


def vision_setup(spec: ModelSpec, vocab_size: int, pad_id: int, image_size: int) -> VisionSetup:
    """The setup of ``spec``: from its local directory, or the tiny default of ``spec.arch`` whose
    image tokens get the ids after the tokenizer's ``vocab_size``."""
    model_dir = Path(spec.path) if spec.path else None
    import_model_module("mlx_vlm", spec.arch)  # registers mlx_vlm without its package __init__ first
    if model_dir is not None:
        config = _read_config(model_dir)
        arch = config.get("model_type")
        if arch != spec.arch:
            raise ValueError(f"{model_dir}/config.json: model_type {arch!r}, but [model].arch is {spec.arch!r}")
        if int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 0)) < vocab_size:
            raise ValueError(f"{model_dir}/config.json: vocab_size is smaller than the tokenizer's {vocab_size}")
    else:
        arch = spec.arch
        config = json.loads(json.dumps(TINY_VLM[arch]))  # a deep copy
        for key, value in spec.config.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key].update(value)
            else:
                config[key] = value
        config["model_type"] = arch
    if arch == "qwen2_vl":
        if model_dir is None:
            ids = {"image_token_id": vocab_size, "video_token_id": vocab_size + 1,
                   "vision_start_token_id": vocab_size + 2, "vision_end_token_id": vocab_size + 3}
            config.update(ids, vocab_size=vocab_size + 4)
        end = config.get("vision_end_token_id", config["vision_start_token_id"] + 1)
        return VisionSetup(arch, config, int(config["image_token_id"]), int(config["vision_start_token_id"]),
                           int(end), _qwen_processor(model_dir, image_size), False, False, image_size)
    size = int(config["vision_config"].get("image_size", image_size))
    if model_dir is None:
        config.update(vocab_size=vocab_size + 1, image_token_index=vocab_size, pad_token_id=pad_id)
        config["text_config"]["vocab_size"] = vocab_size + 1
    config.setdefault("text_config", {})["num_image_tokens"] = (size // int(config["vision_config"]["patch_size"])) ** 2
    return VisionSetup(arch, config, int(config["image_token_index"]), None, None, _siglip_processor(model_dir, size),
                       True, True, size)


def model_config(module: Any, config: dict[str, Any]) -> Any:
    """The architecture module's ``ModelConfig`` of ``config``, its text and vision parts built by
    their own classes, as mlx-vlm's loader builds them (without importing its loader, which
    imports transformers)."""
    config = json.loads(json.dumps(config))
    out = module.ModelConfig.from_dict(config)
    for part in ("text", "vision"):
        key = f"{part}_config"
        if hasattr(out, key) and config.get(key) is not None:
            setattr(out, key, getattr(module, f"{part.title()}Config").from_dict(config[key]))
    return out


def build_vlm(setup: VisionSetup, spec: ModelSpec, seed: int) -> Any:
    """The mlx-vlm model of ``setup``: weights from the model directory, or drawn from ``seed``."""
    module = import_model_module("mlx_vlm", setup.arch)
    if spec.path:
        from mlx_vlm.utils import load_model

        with placeholder_init():
            return load_model(Path(spec.path))
    with placeholder_init():
        model = module.Model(model_config(module, setup.config))
    seeded_init(model, seed)
    return model


def vlm_logits(model: Any, batch: dict[str, Any]) -> Any:
    """Logits of a VLM batch, called the way mlx-vlm's own trainer calls the model:
    ``model(input_ids, pixel_values, attention_mask, **vision kwargs)``."""
    lm = getattr(model, "language_model", None)
    for attr in GENERATION_CACHES:
        if getattr(lm, attr, None) is not None:
            setattr(lm, attr, None)
    extra = {k: v for k, v in batch.items() if k == "image_grid_thw"}
    out = model(batch["inputs"], batch.get("pixel_values"), batch["attention"], **extra)
    for attr in GENERATION_CACHES:
        if getattr(lm, attr, None) is not None:
            setattr(lm, attr, None)
    return getattr(out, "logits", out)
