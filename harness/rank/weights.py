"""Weights without the global RNG: modules constructed with placeholder zeros, then every weight
drawn from a key derived from the scenario seed; and the mlx-lm / mlx-vlm architecture modules
imported without their packages' heavy ``__init__``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

INIT_STD = 0.02


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

    An mlx-vlm architecture also imports its ``processing_<arch>`` module, only to patch
    transformers' ``AutoProcessor`` (2.6 s of transformers per rank on a GPU machine). While
    transformers is not loaded, that module is skipped during the import (an empty stand-in,
    removed afterwards, so a later import gets the real one).
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
    name = f"{package}.models.{arch}"
    processing = f"{name}.processing_{arch}"
    if package != "mlx_vlm" or name in sys.modules or "transformers" in sys.modules or processing in sys.modules:
        return importlib.import_module(name)
    stand_in = sys.modules[processing] = types.ModuleType(processing)
    try:
        return importlib.import_module(name)
    finally:
        if sys.modules.get(processing) is stand_in:
            del sys.modules[processing]
