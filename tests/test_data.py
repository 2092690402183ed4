"""Batch plan, sharding and padding: pure logic, checked without ranks."""

from __future__ import annotations

import numpy as np

from harness.rank.data import ByteTokenizer, collate, global_batches, load_texts, shard, tokenize
from harness.scenario import DataSpec


def test_last_batch_of_each_epoch_is_padded_with_real_rows() -> None:
    plan = global_batches(n_rows=10, global_batch=4, steps=5)
    assert plan == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [0, 1, 2, 3], [4, 5, 6, 7]]


def test_shards_are_strided_and_cover_the_global_batch() -> None:
    batch = [5, 6, 7, 8, 9]
    parts = [shard(batch, r, 2) for r in range(2)]
    assert parts == [[5, 7, 9], [6, 8]]
    assert sorted(sum(parts, [])) == batch
    assert [shard(batch, r, 4) for r in range(4)] == [[5, 9], [6], [7], [8]]


def test_collate_pads_with_pad_id_and_masks_padding() -> None:
    tok = ByteTokenizer()
    b = collate([[1, 2, 3, 4], [7, 8]], tok.pad_id)
    assert b.inputs.tolist() == [[1, 2, 3], [7, tok.pad_id, tok.pad_id]]
    assert b.targets.tolist() == [[2, 3, 4], [8, tok.pad_id, tok.pad_id]]
    assert b.mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b.tokens == 4


def test_generated_corpus_is_seeded_and_leaves_global_rng_alone() -> None:
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    spec = DataSpec(rows=12, min_chars=20, max_chars=80)
    a, b, c = load_texts(spec, 1), load_texts(spec, 1), load_texts(spec, 2)
    assert a == b and a != c
    assert all(20 <= len(t) <= 80 for t in a)
    assert len({len(t) for t in a}) > 3  # variable lengths
    assert (np.random.get_state()[1] == before).all()


def test_tokenize_adds_bos_eos_and_truncates() -> None:
    tok = ByteTokenizer()
    rows = tokenize(["ab", "x" * 50], tok, max_seq_len=10)
    assert rows[0] == [tok.bos_id, ord("a"), ord("b"), tok.eos_id]
    assert len(rows[1]) == 10
