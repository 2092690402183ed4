"""The harness's host reads through device copies (harness.rank.host_read): exact bits, and a
safetensors file MLX reads back as the arrays written."""

import hashlib

import mlx.core as mx
import numpy as np

from harness.rank.host_read import host_bytes, write_safetensors
from harness.rank.models import tree_digest


def _tree():
    f = mx.random.normal((4, 3), key=mx.random.key(1))
    odd = mx.array([[float("nan"), -0.0, float("inf")], [-float("inf"), 1e-40, 0.0]])
    f = mx.concatenate([f, odd])
    return {"w": f, "t": f.T, "b": f.astype(mx.bfloat16), "h": f.astype(mx.float16),
            "blocks": [{"i": mx.arange(6, dtype=mx.int32)}, {"u": mx.array([True, False]), "s": mx.array(2.5),
                       "c": (f[:2] + 1j * f[:2]).astype(mx.complex64), "q": mx.arange(3).astype(mx.uint64)}]}


def _bits(a):
    width = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size]
    return np.array(a.view(width))


def test_host_bytes_are_each_arrays_bits_in_name_order():
    tree = _tree()
    got = list(host_bytes(tree))
    names = [n for n, _, _ in got]
    assert names == sorted(names) and "blocks.1.c" in names
    for _name, p, data in got:
        assert data == np.ascontiguousarray(_bits(p)).tobytes()  # NaN, -0.0, a transposed view: bit for bit


def test_the_digest_hashes_bfloat16_as_its_float32_value():
    b = {"b": mx.array([1.5, -0.0, float("nan")], dtype=mx.bfloat16)}
    h = hashlib.sha256(b"b:mlx.core.bfloat16:(3,)" + np.array(b["b"].astype(mx.float32)).tobytes())
    assert tree_digest(b) == h.hexdigest()
    assert tree_digest(b) != tree_digest({"b": b["b"].astype(mx.float32)})


def test_a_written_file_loads_back_bit_for_bit(tmp_path):
    tree = _tree()
    path = tmp_path / "p.safetensors"
    write_safetensors(path, tree, {"step": "3"})
    back, meta = mx.load(str(path), return_metadata=True)
    assert meta["step"] == "3" and not list(tmp_path.glob(".*"))  # the temporary file was replaced
    from mlx.utils import tree_flatten

    flat = dict(tree_flatten(tree))
    assert set(back) == set(flat)
    for name, p in flat.items():
        assert back[name].dtype == p.dtype and back[name].shape == p.shape
        assert np.array_equal(_bits(back[name]), _bits(p)), name
