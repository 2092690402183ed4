"""The harness's host reads through device copies (harness.rank.host_read): exact bits, never the
trainer's own arrays, the digest of each array's bits, and a safetensors file any reader reads back."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from harness import ablation
from harness.rank import host_read
from harness.rank.host_read import host_bytes, write_safetensors
from harness.rank.models import tree_digest


def _tree() -> dict[str, Any]:
    f = mx.random.normal((4, 3), key=mx.random.key(1))
    odd = mx.array([[float("nan"), -0.0, float("inf")], [-float("inf"), 1e-40, 0.0]])
    f = mx.concatenate([f, odd])
    return {"w": f, "t": f.T, "b": f.astype(mx.bfloat16), "h": f.astype(mx.float16), "e": mx.zeros((0, 3)),
            "blocks": [{"i": mx.arange(6, dtype=mx.int32), "k": mx.arange(-3, 3).astype(mx.int8)},
                       {"u": mx.array([True, False]), "s": mx.array(2.5), "r": f[::-2, 1:],
                        "c": (f[:2] + 1j * f[:2]).astype(mx.complex64), "q": mx.arange(3).astype(mx.uint64)}]}


def _bits(a: Any) -> np.ndarray:
    width = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size]
    return np.array(a.view(width))


def _digest_of_bits(params: Any) -> str:
    """Each array's name, dtype, shape and bits, read directly, in name order."""
    h = hashlib.sha256()
    for name, p in sorted(tree_flatten(params)):
        h.update(f"{name}:{p.dtype}:{p.shape}".encode())
        h.update(np.ascontiguousarray(_bits(p)).tobytes())
    return h.hexdigest()


def test_host_bytes_are_each_arrays_bits_in_name_order_read_from_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    tree = _tree()
    leaves = [p for _, p in tree_flatten(tree)]
    read: list[Any] = []
    bytes_of = host_read._bytes_of
    monkeypatch.setattr(host_read, "_bytes_of", lambda a: read.append(a) or bytes_of(a))
    got = list(host_bytes(tree))
    names = [n for n, _, _ in got]
    assert names == sorted(names) and "blocks.1.c" in names and len(read) == len(leaves) == len(got)
    assert not any(a is p for a in read for p in leaves)  # the host never reads the trainer's own array
    for _name, p, data in got:
        assert data == np.ascontiguousarray(_bits(p)).tobytes()  # NaN, -0.0, views, empty: bit for bit


def test_the_digest_hashes_each_arrays_own_bits_bfloat16_too() -> None:
    tree = _tree()
    assert tree_digest(tree) == _digest_of_bits(tree) and tree_digest({}) == _digest_of_bits({})
    b = {"b": mx.array([1.5, -0.0, float("nan")], dtype=mx.bfloat16)}
    assert tree_digest(b) != tree_digest({"b": b["b"].astype(mx.float32)})  # the dtype is part of it
    # a bfloat16 array's two bytes a value, not its float32 value's four
    header = f"b:{b['b'].dtype}:{b['b'].shape}".encode()
    assert tree_digest(b) == hashlib.sha256(header + np.array(b["b"].view(mx.uint16)).tobytes()).hexdigest()
    assert tree_digest(b) != hashlib.sha256(header + np.array(b["b"].astype(mx.float32)).tobytes()).hexdigest()


def test_a_written_file_is_safetensors_and_loads_back_bit_for_bit(tmp_path: Path) -> None:
    tree = _tree()
    path = tmp_path / "p.safetensors"
    write_safetensors(path, tree, {"step": "3"})
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    assert n % 8 == 0 and header["__metadata__"] == {"format": "mlx", "step": "3"}
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - n  # the data section, in order, no gaps
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    back, meta = mx.load(str(path), return_metadata=True)
    assert meta["step"] == "3" and [p.name for p in tmp_path.iterdir()] == ["p.safetensors"]  # no temporary left
    flat = dict(tree_flatten(tree))
    assert set(back) == set(flat)
    for name, p in flat.items():
        assert back[name].dtype == p.dtype and back[name].shape == p.shape
        assert np.array_equal(_bits(back[name]), _bits(p)), name
    from safetensors import safe_open  # another reader of the format

    with safe_open(str(path), framework="numpy") as f:
        assert np.array_equal(f.get_tensor("blocks.0.i"), np.arange(6, dtype=np.int32))
    write_safetensors(tmp_path / "empty.safetensors", {})
    assert mx.load(str(tmp_path / "empty.safetensors")) == {}


def test_a_write_that_fails_part_way_leaves_the_old_file_and_no_temporary(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.safetensors"
    write_safetensors(path, {"a": mx.ones((3,))})
    before = path.read_bytes()

    def failing(params: Any) -> Any:
        yield "a", None, b"\0" * 12
        raise OSError("disk full")

    monkeypatch.setattr(host_read, "host_bytes", failing)
    with pytest.raises(OSError, match="disk full"):
        write_safetensors(path, {"a": mx.zeros((3,)), "b": mx.zeros((2,))})
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["p.safetensors"]


@pytest.mark.parametrize(("ablate", "cleared"), [("", 1), ("cache_clear", 0), ("sampler", 1)])
def test_on_cuda_the_reads_clear_mlx_cache_once_unless_the_benchmark_turns_it_off(
        monkeypatch: pytest.MonkeyPatch, ablate: str, cleared: int) -> None:
    clears: list[int] = []
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)  # as on CUDA, where read copies move to managed memory
    monkeypatch.setattr(mx, "clear_cache", lambda: clears.append(1))
    monkeypatch.setenv(ablation.VAR, ablate)
    assert len(list(host_bytes(_tree()))) == 12 and len(clears) == cleared
