"""The harness's host reads of a trainer's parameters, made through device copies.

On MLX's CUDA backend (``mlx/backend/cuda/allocator.cpp``) a buffer the host reads moves from
device memory to managed memory for good, and a freed buffer stays in MLX's cache, from which
later allocations of its size are served. Reading the trainer's own arrays would therefore leave
its step on managed buffers that a bare process would not have. Every read here copies one array
on the device, reads the copy and drops it, so the trainer's arrays are never read by the host;
on CUDA MLX's cache is then cleared, so that no read copy is served again (the next step allocates
afresh: a cost at each step the harness reads, which is the start and each ``digest_every`` step).
On unified memory (Metal, CPU) nothing moves and the cache is left as it is; the copies cost one
array's size at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness import ablation
from harness.dtypes import dtype_name

# MLX dtype name -> (safetensors dtype, unsigned type of the same width that carries its bits)
_TYPES = {
    "bool": ("BOOL", "uint8"), "uint8": ("U8", "uint8"), "int8": ("I8", "uint8"),
    "uint16": ("U16", "uint16"), "int16": ("I16", "uint16"), "float16": ("F16", "uint16"),
    "bfloat16": ("BF16", "uint16"), "uint32": ("U32", "uint32"), "int32": ("I32", "uint32"),
    "float32": ("F32", "uint32"), "uint64": ("U64", "uint64"), "int64": ("I64", "uint64"),
    "float64": ("F64", "uint64"), "complex64": ("C64", "uint64"),
}


def host_bytes(params: Any) -> Iterator[tuple[str, Any, bytes]]:
    """``(name, array, bytes)`` for each array of a parameter tree, in name order: its bits in
    C order, read from a device copy (module docstring)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    try:
        for name, p in sorted(tree_flatten(params), key=lambda kv: kv[0]):
            # an exact copy: the bits through an integer op (a float op could change a NaN's)
            bits = getattr(mx, _TYPES[dtype_name(p)][1])
            copy = mx.bitwise_or(p.view(bits), mx.array(0, dtype=bits))
            mx.eval(copy)
            data = _bytes_of(copy)
            del copy  # freed before the caller goes on (or stops): the cache clear below sees it
            yield name, p, data
    finally:
        if mx.cuda.is_available() and ablation.on("cache_clear"):
            mx.clear_cache()


def _bytes_of(a: Any) -> bytes:
    import numpy as np

    return np.ascontiguousarray(np.array(a)).tobytes()


def write_safetensors(final: Path | str, params: Any, metadata: dict[str, str] | None = None) -> None:
    """A parameter tree (or a module's parameters) into the safetensors file ``final``, atomically
    (a reader never sees a partial file), through ``host_bytes``."""
    params = params.parameters() if hasattr(params, "parameters") else params
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp")
    header, entries = _layout(params, {"format": "mlx", **(metadata or {})})
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    try:
        with open(tmp, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            for (name, _p, data), size in zip(host_bytes(params), entries, strict=True):
                if len(data) != size:
                    raise RuntimeError(f"{name}: read {len(data)} bytes, its header says {size}")
                f.write(data)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)  # a write that failed part way leaves nothing behind


def _layout(params: Any, metadata: dict[str, str]) -> tuple[dict[str, Any], list[int]]:
    """The safetensors header of ``params`` (in ``host_bytes``'s order) and each array's size in bytes."""
    from mlx.utils import tree_flatten

    header: dict[str, Any] = {"__metadata__": metadata}
    sizes, offset = [], 0
    for name, p in sorted(tree_flatten(params), key=lambda kv: kv[0]):
        size = p.size * p.dtype.size
        header[name] = {"dtype": _TYPES[dtype_name(p)][0], "shape": list(p.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
        sizes.append(size)
    return header, sizes
