"""Global batch plans, each rank's share of them, streaming shares, eval shares and collation.

Global batches are cut once: rows in file order (``ordered``), permuted once by a local RNG from
the scenario seed (``shuffled``), or sorted by length so batches hold similar lengths
(``length_sorted``). The last batch is padded by repeating real rows from the start. Each epoch
visits the fixed batches in order (``ordered``) or in an order permuted by a per-epoch local RNG.
Because the batches are fixed, a rank's rows are the same every epoch, and it keeps only those.

Each optimizer step's global batch is split into ``grad_accum`` micro-batches; rank r takes
positions r, r+N, ... of each micro-batch. None of this depends on the world size, so N ranks
see exactly the rows one process sees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.data.sources import Example, RowSource, reject_presharded

PLAN_STREAM, EPOCH_STREAM, DROPOUT_STREAM = 2, 3, 5


@dataclass
class Plan:
    """Fixed global batches of row indices, visited per epoch."""

    batches: list[list[int]]
    seed: int | None = None  # None: the same batch order every epoch

    def batch(self, step: int) -> list[int]:
        """Row indices of optimizer step ``step`` (1-based)."""
        epoch, k = divmod(step - 1, len(self.batches))
        if self.seed is None:
            return self.batches[k]
        order = np.random.default_rng([self.seed, EPOCH_STREAM, epoch]).permutation(len(self.batches))
        return self.batches[int(order[k])]


def make_plan(lengths: list[int], global_batch: int, order: str, seed: int) -> Plan:
    n = len(lengths)
    if order == "ordered":
        idx = list(range(n))
    elif order == "shuffled":
        idx = np.random.default_rng([seed, PLAN_STREAM]).permutation(n).tolist()
    else:
        idx = np.argsort(np.asarray(lengths), kind="stable").tolist()
    batches = []
    for start in range(0, n, global_batch):
        batch = idx[start : start + global_batch]
        batch += [idx[j % n] for j in range(global_batch - len(batch))]  # repeat real rows
        batches.append(batch)
    return Plan(batches, None if order == "ordered" else seed)


def local_positions(global_batch: int, grad_accum: int, rank: int, world_size: int, emulate: int = 1
                    ) -> list[list[int]]:
    """Positions in the global batch that ``rank`` computes, per micro-step; with ``emulate`` = N,
    the micro-steps of each of N ranks, rank after rank."""
    micro = global_batch // grad_accum
    if emulate > 1:
        return [p for r in range(emulate) for p in local_positions(global_batch, grad_accum, r, emulate)]
    return [list(range(m * micro, (m + 1) * micro))[rank::world_size] for m in range(grad_accum)]


def uneven_last(global_batch: int, grad_accum: int, rank: int, world_size: int) -> bool:
    """Whether this rank's share of each micro-batch is smaller than rank 0's (rows do not divide)."""
    micro = global_batch // grad_accum
    return len(range(micro)[rank::world_size]) < len(range(micro)[0::world_size])


def owned_rows(plan: Plan, positions: list[list[int]]) -> set[int]:
    pos = [p for micro in positions for p in micro]
    return {b[p] for b in plan.batches for p in pos}


@dataclass
class RankShare:
    """The rows this rank holds (only its own) and how to find each step's micro-batches."""

    plan: Plan
    rows: dict[int, Example]
    positions: list[list[int]]
    total_rows: int

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.rows.values())

    def micro_batches(self, step: int) -> list[list[tuple[int, Example]]]:
        batch = self.plan.batch(step)
        return [[(batch[p], self.rows[batch[p]]) for p in micro] for micro in self.positions]


def materialize(source: RowSource, encode: Callable[[str, object], Example], global_batch: int,
                positions: list[list[int]], order: str, seed: int) -> RankShare:
    """Read the source twice: lengths (or a row count) first, then only the rows at ``positions``."""
    if order == "length_sorted":
        lengths = [len(encode(where, row).ids) for where, row in source()]
    else:
        lengths = [0 for _ in source()]
    if not lengths:
        raise ValueError("the dataset has no rows")
    plan = make_plan(lengths, global_batch, order, seed)
    mine = owned_rows(plan, positions)
    rows = {i: encode(where, row) for i, (where, row) in enumerate(source()) if i in mine}
    return RankShare(plan, rows, positions, len(lengths))


@dataclass
class StreamShare:
    """This rank's share of a stream, read in order without materializing it.

    Every rank reads the same stream and encodes only the rows at its own positions (plus the
    epoch's first global batch, kept to pad the epoch's last, short batch the way ``make_plan``
    does). Memory stays at about two global batches whatever the stream's length. ``source`` is a
    function that opens the stream, or a re-iterable object of ``(where, row)`` pairs; one that
    was already split per rank is refused.
    """

    source: RowSource | Iterable[tuple[str, object]]
    encode: Callable[[str, object], Example]
    global_batch: int
    positions: list[list[int]]
    peak_nbytes: int = 0
    rows_read: int = 0
    _it: Iterator | None = None
    _first: list[Example] = field(default_factory=list)
    _index: int = 0

    def __post_init__(self) -> None:
        reject_presharded(self.source)
        self._mine = {p for micro in self.positions for p in micro}

    def micro_batches(self, step: int) -> list[list[tuple[int, Example]]]:
        """The next global batch's micro-batches for this rank (steps come in order)."""
        got: dict[int, Example] = {}
        count = 0
        for _ in range(2):  # at most one epoch boundary per batch
            if self._it is None:
                rows = self.source() if callable(self.source) else self.source
                self._it, self._first, self._index = iter(rows), [], 0
            for where, row in self._it:
                first = self._index < self.global_batch
                if first or count in self._mine:
                    ex = self.encode(where, row)
                    if first:
                        self._first.append(ex)
                    got[count] = ex
                self._index += 1
                self.rows_read += 1
                count += 1
                if count == self.global_batch:
                    break
            else:
                self._it = None  # the epoch ended
                if self._index == 0:
                    raise ValueError("the stream yielded no rows")
                if count:
                    for p in range(count, self.global_batch):  # pad with the epoch's first rows
                        got[p] = self._first[(p - count) % len(self._first)]
                    count = self.global_batch
            if count == self.global_batch:
                break
        held = sum(e.nbytes for e in self._first) + sum(got[p].nbytes for p in self._mine if p in got)
        self.peak_nbytes = max(self.peak_nbytes, held)
        base = (step - 1) * self.global_batch
        return [[(base + p, got[p]) for p in micro] for micro in self.positions]

    def skip(self, steps: int) -> None:
        """Read past the first ``steps`` global batches: a resumed run continues after them."""
        for step in range(1, steps + 1):
            self.micro_batches(step)

    @property
    def nbytes(self) -> int:
        return self.peak_nbytes


@dataclass
class EvalShare:
    """This rank's eval rows (r, r+N, ...), padded with empty rows to the longest rank's count."""

    batches: list[list[Example]]
    real_rows: int
    pad_rows: int
    total_rows: int

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for b in self.batches for e in b)


def eval_share(source: RowSource, encode: Any, batch: int, rank: int, world_size: int) -> EvalShare:
    """Rows r, r+N, ... of the eval set, padded with ``encode.pad_example()`` rows."""
    mine, total = [], 0
    for i, (where, row) in enumerate(source()):
        total += 1
        if i % world_size == rank:
            mine.append(encode(where, row))
    if total == 0:
        raise ValueError("the eval set has no rows")
    per_rank = -(-total // world_size)
    pads = per_rank - len(mine)
    rows = mine + [encode.pad_example() for _ in range(pads)]
    return EvalShare([rows[i : i + batch] for i in range(0, len(rows), batch)], len(mine), pads, total)


@dataclass
class LocalBatch:
    """Inputs, targets and a loss mask of one rank's rows, padded to a common width; for a
    VLM also the attention mask (1 on real tokens) and the rows' vision inputs, concatenated."""

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    attention: np.ndarray | None = None
    vision: dict[str, np.ndarray] | None = None
    images: int = 0

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())

    def arrays(self) -> dict[str, Any]:
        """The batch as MLX arrays, the form the loss function takes."""
        import mlx.core as mx

        out = {"inputs": mx.array(self.inputs), "targets": mx.array(self.targets), "mask": mx.array(self.mask)}
        if self.attention is not None:
            out["attention"] = mx.array(self.attention)
        for k, v in (self.vision or {}).items():
            out[k] = mx.array(v)
        return out


def collate(rows: list[Example], pad_id: int, dropout: float = 0.0, keys: list[tuple[int, ...]] | None = None,
            vlm: bool = False, protect: tuple[int, ...] = (), pad_to: int = 1) -> LocalBatch:
    """Pad with the tokenizer's pad id to the longest row's inputs, rounded up to a multiple of
    ``pad_to``; mask padding and unsupervised targets.

    ``dropout`` replaces that fraction of input tokens with the pad id, drawn from a generator
    keyed by each row's ``keys`` entry (seed, step, row), so any rank, and any re-run, draws the
    same tokens for the same row; ``protect`` ids (image tokens) are never dropped. A ``vlm``
    batch also carries its attention mask and the vision inputs of its rows that have an image.
    """
    width = -(-(max(len(r.ids) for r in rows) - 1) // pad_to) * pad_to
    inputs = np.full((len(rows), width), pad_id, dtype=np.int32)
    targets = np.full((len(rows), width), pad_id, dtype=np.int32)
    mask = np.zeros((len(rows), width), dtype=np.float32)
    attention = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        n = len(r.ids) - 1
        inputs[i, :n] = r.ids[:-1]
        targets[i, :n] = r.ids[1:]
        mask[i, :n] = r.supervised[1:]
        attention[i, :n] = 1
        if dropout > 0 and keys is not None:
            drop = np.random.default_rng([*keys[i], DROPOUT_STREAM]).random(n) < dropout
            inputs[i, :n][drop & ~np.isin(r.ids[:-1], list(protect))] = pad_id
    with_images = [r.vision for r in rows if r.vision is not None]
    if not vlm and not with_images:
        return LocalBatch(inputs, targets, mask)
    vision = {k: np.concatenate([v[k] for v in with_images]) for k in with_images[0]} if with_images else None
    return LocalBatch(inputs, targets, mask, attention, vision, len(with_images))
