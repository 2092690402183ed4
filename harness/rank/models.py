"""Models: mlx-lm architectures built from a config with seeded weights, or loaded from disk.

Modules are constructed with placeholder zeros (mlx.nn's default init would draw from MLX's
global RNG); every weight is then drawn from a key derived from the scenario seed, so the result
depends on the seed alone and the harness never seeds, reads or advances the global RNG.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from harness.rank.weights import import_model_module, placeholder_init, seeded_init
from harness.scenario import ModelSpec

TINY = {
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
}
def text_architecture(model_type: str) -> Any:
    """mlx-lm's module of a text architecture (its ``Model`` and ``ModelArgs``)."""
    return import_model_module("mlx_lm", model_type)


def model_config(spec: ModelSpec, vocab_size: int) -> dict[str, Any]:
    """The tiny default config of ``spec.arch``, overridden by the scenario's ``[model.config]``."""
    config = {**TINY[spec.arch], **spec.config, "model_type": spec.arch}
    config["vocab_size"] = max(int(config.get("vocab_size", 0)), vocab_size)
    return config


def build_model(spec: ModelSpec, vocab_size: int, seed: int, vision: Any = None) -> tuple[Any, dict[str, Any]]:
    """The scenario's model (float parameters cast to ``spec.dtype``) and its config; a
    vision-language model when ``vision`` (a ``VisionSetup``) is given."""
    import mlx.core as mx
    from mlx.utils import tree_map

    if vision is not None:
        from harness.rank.vision import build_vlm

        model, config = build_vlm(vision, spec, seed), vision.config
    elif spec.path:
        from mlx_lm.utils import load_model

        with placeholder_init():  # every weight comes from the directory
            model, config = load_model(Path(spec.path))
        if config.get("vocab_size", 0) < vocab_size:
            raise ValueError(
                f"{spec.path}: vocab_size {config.get('vocab_size')} is smaller than the tokenizer's {vocab_size}"
            )
    else:
        config = model_config(spec, vocab_size)
        arch = text_architecture(spec.arch)
        with placeholder_init():
            model = arch.Model(arch.ModelArgs.from_dict(config))
        seeded_init(model, seed)
    dtype = getattr(mx, spec.built_dtype)
    model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    mx.eval(model.parameters())
    return model, config


START_ABLATED = "not taken: the start part was turned off"  # what a benchmark's rank reports instead


def start_digest(params: Any, wanted: bool = True) -> str | None:
    """``tree_digest`` of the parameters training starts from, where the job ``wanted`` it
    (``TrainJob.digest_start``; else None, and nothing is read), ``START_ABLATED`` where a
    benchmark turned the ``start`` part off (``harness.ablation``)."""
    from harness import ablation

    if not wanted:
        return None
    return tree_digest(params) if ablation.on("start") else START_ABLATED


def param_digest(model: Any) -> str:
    """sha256 over every parameter's name, dtype, shape and bytes: equal iff replicas are equal."""
    return tree_digest(model.parameters())


def tree_digest(params: Any) -> str:
    """``param_digest`` of a parameter tree (nested dicts and lists of arrays): each array's name,
    dtype, shape and bits, read through ``host_read`` (a bfloat16 array's own two bytes a value,
    not a float32 copy's four)."""
    from harness.rank.host_read import host_bytes

    h = hashlib.sha256()
    for name, p, data in host_bytes(params):
        h.update(f"{name}:{p.dtype}:{p.shape}".encode())
        h.update(data)
    return h.hexdigest()


def param_count(model: Any) -> int:
    from mlx.utils import tree_flatten

    params = model.parameters() if hasattr(model, "parameters") else model
    return sum(p.size for _, p in tree_flatten(params))


def apply_lora(model: Any, s: Any) -> None:
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
