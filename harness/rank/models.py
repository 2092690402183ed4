"""Models: mlx-lm architectures built from a config with seeded weights, or loaded from disk.

Modules are constructed with placeholder zeros (mlx.nn's default init would draw from MLX's
global RNG); every weight is then drawn from a key derived from the scenario seed, so the result
depends on the seed alone and the harness never seeds, reads or advances the global RNG.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
INIT_STD = 0.02


def model_config(spec: ModelSpec, vocab_size: int) -> dict[str, Any]:
    """The tiny default config of ``spec.arch``, overridden by the scenario's ``[model.config]``."""
    config = {**TINY[spec.arch], **spec.config, "model_type": spec.arch}
    config["vocab_size"] = max(int(config.get("vocab_size", 0)), vocab_size)
    return config


def seeded_init(model: Any, seed: int) -> None:
    """Replace every parameter: norms to one, biases to zero, matrices N(0, INIT_STD)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    key = mx.random.key(seed)
    new = []
    for name, p in sorted(tree_flatten(model.parameters())):
        key, sub = mx.random.split(key)
        if ("norm" in name or ".ln_" in name) and p.ndim == 1:
            value = mx.ones(p.shape, dtype=p.dtype)
        elif name.endswith(".bias"):
            value = mx.zeros(p.shape, dtype=p.dtype)
        else:
            value = (mx.random.normal(p.shape, key=sub) * INIT_STD).astype(p.dtype)
        new.append((name, value))
    model.update(tree_unflatten(new))


@contextlib.contextmanager
def placeholder_init() -> Iterator[None]:
    """Layer constructors get zeros instead of drawing from MLX's global RNG.

    mlx.nn layers initialise their weights from the global RNG, and MLX cannot restore that
    state. Every weight is replaced afterwards (``seeded_init`` or the model directory's
    weights), so construction uses zeros and the global RNG is never advanced.
    """
    import mlx.core as mx

    names = ("uniform", "normal", "truncated_normal")
    saved = {n: getattr(mx.random, n) for n in names}

    def zeros(*args: Any, shape: Any = None, dtype: Any = None, **kwargs: Any) -> Any:
        shape = shape if shape is not None else next((a for a in args if isinstance(a, list | tuple)), ())
        return mx.zeros(shape, dtype=dtype or mx.float32)

    try:
        for n in names:
            setattr(mx.random, n, zeros)
        yield
    finally:
        for n, f in saved.items():
            setattr(mx.random, n, f)


def import_model_module(package: str, arch: str) -> Any:
    """``<package>.models.<arch>`` without running the package's ``__init__``.

    ``mlx_lm``'s and ``mlx_vlm``'s package ``__init__`` import their generation and serving
    stacks; the architecture modules need none of it. When nobody has imported the package yet,
    it is registered from its location and only the architecture module is imported.
    """
    import importlib
    import importlib.util
    import sys
    import types

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" banner per rank
    if package not in sys.modules:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"{package.replace('_', '-')} is not installed")
        pkg = types.ModuleType(package)
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules[package] = pkg
    return importlib.import_module(f"{package}.models.{arch}")


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
        arch = import_model_module("mlx_lm", spec.arch)
        with placeholder_init():
            model = arch.Model(arch.ModelArgs.from_dict(config))
        seeded_init(model, seed)
    dtype = getattr(mx, spec.dtype)
    model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    mx.eval(model.parameters())
    return model, config


def param_digest(model: Any) -> str:
    """sha256 over every parameter's name, dtype, shape and bytes: equal iff replicas are equal."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    for name, p in sorted(tree_flatten(model.parameters())):
        a = np.array(p.astype(mx.float32)) if p.dtype == mx.bfloat16 else np.array(p)
        h.update(f"{name}:{p.dtype}:{p.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def param_count(model: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(p.size for _, p in tree_flatten(model.parameters()))
