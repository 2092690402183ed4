"""One rank's data for the reference trainer: its share of the train rows (materialized or
streamed), of the eval rows, and the tokenizer and image preprocessing that encode them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.data.sources import Encoder, row_source
from harness.data.tokenizers import Tokenizer, load_tokenizer
from harness.scenario import Scenario
from harness.trainers.reference.batching import RankShare, StreamShare, eval_share, local_positions, materialize


@dataclass
class RankData:
    tok: Tokenizer
    train: RankShare | StreamShare
    evals: Any  # EvalShare | None
    vision: Any = None  # VisionSetup of a vision-language model
    encoder: Any = None

    @property
    def protected(self) -> tuple[int, ...]:
        """Token ids input dropout must not touch (image tokens must match image features)."""
        return () if self.vision is None else self.vision.block_ids


def load_data(s: Scenario, rank: int, world_size: int, done_steps: int = 0, emulate: int = 1) -> RankData:
    """This rank's share of the train rows (materialized or streamed) and of the eval rows; a
    stream is read past the ``done_steps`` batches a resumed run has already trained on. A
    vision-language model's rows are image rows, encoded with the model's own preprocessing.
    ``emulate`` = N: one process holding N ranks' shards (a noise-floor twin)."""
    d, t = s.data, s.train
    tok = load_tokenizer(d)
    vision, rows, encoder = None, row_source, Encoder(tok, d)
    if s.model.vision:
        from harness.data.images import VisionEncoder, image_row_source
        from harness.rank.vision import vision_setup

        vision = vision_setup(s.model, tok.vocab_size, tok.pad_id, d.image_size)
        rows, encoder = image_row_source, VisionEncoder(tok, d, vision)
    source = rows(d, s.seed, "train")
    positions = local_positions(t.global_batch, t.grad_accum, rank, world_size, emulate)
    if d.streaming:
        stream = StreamShare(source, encoder, t.global_batch, positions)
        stream.skip(done_steps)
        train: RankShare | StreamShare = stream
    else:
        train = materialize(source, encoder, t.global_batch, positions, d.order, s.seed)
    evals = None
    if d.eval_rows or d.eval_path:
        evals = eval_share(rows(d, s.seed, "eval"), encoder, t.eval_batch, rank, world_size)
    return RankData(tok, train, evals, vision, encoder)
