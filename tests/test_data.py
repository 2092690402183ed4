"""Data paths as pure logic: forms and masks, plans, shares, streaming, eval padding, collation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harness.data.sources import Encoder, Example, reject_presharded, row_source
from harness.data.tokenizers import ByteTokenizer
from harness.scenario import DataSpec
from harness.trainers.reference.batching import (
    StreamShare,
    collate,
    eval_share,
    local_positions,
    make_plan,
    materialize,
    owned_rows,
    uneven_last,
)

TOK = ByteTokenizer()


def ex(n: int, first: int = 0) -> Example:
    return Example(np.arange(first, first + n, dtype=np.int32), np.ones(n, dtype=bool))


def test_ordered_plan_pads_the_last_batch_with_real_rows_and_repeats_per_epoch() -> None:
    plan = make_plan([0] * 10, 4, "ordered", seed=1)
    assert [plan.batch(s) for s in range(1, 6)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [0, 1, 2, 3],
                                                     [4, 5, 6, 7]]


def test_shuffled_plan_is_seeded_reorders_batches_per_epoch_and_leaves_global_rng_alone() -> None:
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    a, b, c = (make_plan([0] * 12, 4, "shuffled", seed=s) for s in (5, 5, 6))
    epoch1 = [a.batch(s) for s in (1, 2, 3)]
    assert epoch1 == [b.batch(s) for s in (1, 2, 3)] and epoch1 != [c.batch(s) for s in (1, 2, 3)]
    assert sorted(sum(epoch1, [])) == list(range(12)) and epoch1 != [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    epochs = {tuple(map(tuple, (a.batch(e * 3 + s) for s in (1, 2, 3)))) for e in range(6)}
    assert len(epochs) > 1  # batch order changes between epochs; batches themselves stay fixed
    assert (np.random.get_state()[1] == before).all()


def test_length_sorted_plan_groups_similar_lengths() -> None:
    lengths = [9, 1, 8, 2, 7, 3, 6, 4]
    plan = make_plan(lengths, 4, "length_sorted", seed=0)
    assert sorted(map(sorted, plan.batches)) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_positions_split_micro_batches_strided_and_cover_everything() -> None:
    assert local_positions(8, 2, 0, 2) == [[0, 2], [4, 6]]
    assert local_positions(8, 2, 1, 2) == [[1, 3], [5, 7]]
    cover = sorted(p for r in range(3) for m in local_positions(6, 1, r, 3) for p in m)
    assert cover == list(range(6))
    # one process emulating 2 ranks: rank 0's micro-steps, then rank 1's
    assert local_positions(8, 2, 0, 1, emulate=2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert uneven_last(6, 2, 1, 2) and not uneven_last(6, 2, 0, 2) and not uneven_last(8, 2, 1, 2)


def test_each_rank_holds_only_its_share() -> None:
    spec = DataSpec(rows=40)
    source, enc = row_source(spec, 3), Encoder(TOK, spec)
    shares = [materialize(source, enc, 8, local_positions(8, 1, r, 4), "shuffled", 3) for r in range(4)]
    assert [len(s.rows) for s in shares] == [10, 10, 10, 10]
    assert set().union(*(s.rows for s in shares)) == set(range(40))
    one = materialize(source, enc, 8, local_positions(8, 1, 0, 1), "shuffled", 3)
    assert sum(s.nbytes for s in shares) == one.nbytes
    assert owned_rows(one.plan, local_positions(8, 1, 0, 1)) == set(range(40))


def test_stream_share_matches_the_materialized_ordered_plan() -> None:
    spec = DataSpec(rows=11)
    source = row_source(spec, 9)
    for ws in (1, 2, 3):
        for r in range(ws):
            mat = materialize(source, Encoder(TOK, spec), 6, local_positions(6, 2, r, ws), "ordered", 9)
            stream = StreamShare(source, Encoder(TOK, spec), 6, local_positions(6, 2, r, ws))
            for step in range(1, 6):  # two epochs and a bit; each epoch's last batch is padded
                got = [[e.ids.tolist() for _, e in m] for m in stream.micro_batches(step)]
                want = [[e.ids.tolist() for _, e in m] for m in mat.micro_batches(step)]
                assert got == want, (ws, r, step)
    assert stream.peak_nbytes < mat.nbytes * 3


def test_presharded_sources_are_rejected() -> None:
    class Sharded(list):
        _distributed = {"rank": 1, "world_size": 2}

    with pytest.raises(ValueError, match="already sharded per rank"):
        reject_presharded(Sharded())
    reject_presharded([{"text": "fine"}])
    rows = [(f"row {i}", {"text": f"row number {i}"}) for i in range(5)]
    with pytest.raises(ValueError, match="already sharded per rank"):
        StreamShare(Sharded(rows), Encoder(TOK, DataSpec()), 2, local_positions(2, 1, 0, 2))
    whole = StreamShare(rows, Encoder(TOK, DataSpec()), 2, local_positions(2, 1, 1, 2))  # a plain re-iterable works
    assert [[i for i, _ in m] for m in whole.micro_batches(1)] == [[1]]


def test_eval_share_pads_short_ranks_with_zero_token_rows() -> None:
    spec = DataSpec(eval_rows=5)
    source, enc = row_source(spec, 1, "eval"), Encoder(TOK, spec)
    shares = [eval_share(source, enc, 2, r, 2) for r in range(2)]
    assert [(s.real_rows, s.pad_rows) for s in shares] == [(3, 0), (2, 1)]
    assert [len(b) for b in shares[1].batches] == [2, 1]
    assert collate(shares[1].batches[1], TOK.pad_id).tokens == 0


def test_forms_and_response_only_masks(tmp_path: Path) -> None:
    rows = [
        {"prompt": "2+2=", "completion": "4"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"text": "ab"},
    ]
    spec = DataSpec(max_seq_len=64)
    pc = Encoder(TOK, spec)("r1", rows[0])
    # bos + "2+2=" (not supervised) + "4" + eos (supervised)
    assert pc.ids.tolist() == [TOK.bos_id, *b"2+2=", ord("4"), TOK.eos_id]
    assert pc.supervised.tolist() == [False] * 5 + [True, True] and pc.tokens == 2
    chat = Encoder(TOK, spec)("r2", rows[1])
    text = bytes(int(i) for i in chat.ids if i < 256).decode()
    assert text == "<|user|>\nhi\n<|assistant|>\nyo\n"
    sup = bytes(int(i) for i, s in zip(chat.ids, chat.supervised, strict=True) if s and i < 256).decode()
    assert sup == "yo" and chat.tokens == 3  # "yo" + eos
    txt = Encoder(TOK, spec)("r3", rows[2])
    assert txt.tokens == 3  # every target: "a", "b", eos
    everything = Encoder(TOK, DataSpec(response_only=False))("r1", rows[0])
    assert everything.tokens == len(everything.ids) - 1
    with pytest.raises(ValueError, match=r"r9: expected a row with \"prompt\" and \"completion\""):
        Encoder(TOK, DataSpec(format="prompt_completion"))("r9", {"text": "x"})
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [rows[0], rows[0], rows[2]]))
    src = row_source(DataSpec(source="jsonl", path=str(path)), 0)
    enc = Encoder(TOK, DataSpec())
    with pytest.raises(ValueError, match=r"rows\.jsonl:3: expected a row with \"prompt\""):
        [enc(w, r) for w, r in src()]


def test_truncated_prompt_leaves_zero_supervised_tokens() -> None:
    e = Encoder(TOK, DataSpec(max_seq_len=8))("r", {"prompt": "x" * 20, "completion": "y"})
    assert len(e.ids) == 8 and e.tokens == 0


def test_collate_pads_with_pad_id_masks_and_drops_inputs_deterministically() -> None:
    b = collate([ex(4, 1), ex(2, 7)], TOK.pad_id)
    assert b.inputs.tolist() == [[1, 2, 3], [7, TOK.pad_id, TOK.pad_id]]
    assert b.targets.tolist() == [[2, 3, 4], [8, TOK.pad_id, TOK.pad_id]]
    assert b.mask.tolist() == [[1, 1, 1], [1, 0, 0]] and b.tokens == 4
    rows = [ex(60, 1)]
    d1 = collate(rows, TOK.pad_id, 0.3, [(1, 2, 3)])
    d2 = collate(rows, TOK.pad_id, 0.3, [(1, 2, 3)])
    d3 = collate(rows, TOK.pad_id, 0.3, [(1, 2, 4)])
    assert (d1.inputs == d2.inputs).all() and (d1.inputs != d3.inputs).any()
    assert 5 < int((d1.inputs == TOK.pad_id).sum()) < 35 and (d1.targets == collate(rows, TOK.pad_id).targets).all()


def test_generated_rows_are_seeded_variable_and_leave_global_rng_alone() -> None:
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    spec = DataSpec(rows=12, min_chars=20, max_chars=80)
    a, b, c = ([r["text"] for _, r in row_source(spec, s)()] for s in (1, 1, 2))
    assert a == b and a != c
    assert all(20 <= len(t) <= 80 for t in a) and len({len(t) for t in a}) > 3
    assert (np.random.get_state()[1] == before).all()


def test_golden_shards_for_five_rows_local_batch_two_two_ranks() -> None:
    """The seed PR's golden case: 5 rows, local batch 2, 2 ranks (global batch 4)."""
    spec = DataSpec(rows=5)
    source, enc = row_source(spec, 0), Encoder(TOK, spec)
    shares = [materialize(source, enc, 4, local_positions(4, 1, r, 2), "ordered", 0) for r in range(2)]
    rows = [[[i for i, _ in m] for m in s.micro_batches(step)] for step in (1, 2) for s in shares]
    # step 1: rows 0-3; step 2: row 4 then rows 0, 1, 2 repeated to fill the batch
    assert rows == [[[0, 2]], [[1, 3]], [[4, 1]], [[0, 2]]]
    assert sorted(shares[0].rows) == [0, 1, 2, 4] and sorted(shares[1].rows) == [0, 1, 2, 3]
