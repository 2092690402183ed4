"""The harness's host reads of a trainer's parameters, made through device copies.

On MLX's CUDA backend (``mlx/backend/cuda/allocator.cpp``) a buffer the host reads moves from
device memory to managed memory for good, and a freed buffer stays in MLX's cache, from which
later allocations of its size are served. Reading the trainer's own arrays would therefore leave
its step on managed buffers that a bare process would not have. Every read here copies one array
on the device, reads the copy, drops it, and clears MLX's cache at the end, so the trainer's arrays
and the cache stay as they were (beyond the cache being emptied). On unified memory (Metal, CPU)
the copies cost one array's size at a time and nothing else.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# MLX dtype name -> (safetensors dtype, unsigned type of the same width that carries its bits)
_TYPES = {
    "bool": ("BOOL", "uint8"), "uint8": ("U8", "uint8"), "int8": ("I8", "uint8"),
    "uint16": ("U16", "uint16"), "int16": ("I16", "uint16"), "float16": ("F16", "uint16"),
    "bfloat16": ("BF16", "uint16"), "uint32": ("U32", "uint32"), "int32": ("I32", "uint32"),
    "float32": ("F32", "uint32"), "uint64": ("U64", "uint64"), "int64": ("I64", "uint64"),
    "float64": ("F64", "uint64"), "complex64": ("C64", "uint64"),
}


def dtype_name(a: Any) -> str:
    return str(a.dtype).rpartition(".")[2]


def host_bytes(params: Any, widen_bfloat16: bool = False) -> Iterator[tuple[str, Any, bytes]]:
    """``(name, array, bytes)`` for each array of a parameter tree, in name order: its bits in
    C order, read from a device copy (module docstring). ``widen_bfloat16``: a bfloat16 array's
    bytes are those of its float32 value."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    try:
        for name, p in sorted(tree_flatten(params), key=lambda kv: kv[0]):
            if widen_bfloat16 and p.dtype == mx.bfloat16:
                copy = p.astype(mx.float32)
            else:  # an exact copy: the bits through an integer op (a float op could change a NaN's)
                bits = getattr(mx, _TYPES[dtype_name(p)][1])
                copy = mx.bitwise_or(p.view(bits), mx.array(0, dtype=bits))
            mx.eval(copy)
            yield name, p, _bytes_of(copy)
            del copy
    finally:
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
    header: dict[str, Any] = {"__metadata__": {"format": "mlx", **(metadata or {})}}
    entries = list(_layout(params, header))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for (name, _p, data), size in zip(host_bytes(params), entries, strict=True):
            if len(data) != size:
                raise RuntimeError(f"{name}: read {len(data)} bytes, its header says {size}")
            f.write(data)
    os.replace(tmp, final)


def _layout(params: Any, header: dict[str, Any]) -> Iterator[int]:
    """Each array's header entry (in ``host_bytes``'s order), yielding its size in bytes."""
    from mlx.utils import tree_flatten

    offset = 0
    for name, p in sorted(tree_flatten(params), key=lambda kv: kv[0]):
        size = p.size * p.dtype.size
        header[name] = {"dtype": _TYPES[dtype_name(p)][0], "shape": list(p.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
        yield size
