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

    def summary(self, rss_delta: int) -> dict[str, Any]:
        """What the rank's result reports of its data: the rows it held or read, their bytes, and
        the RSS loading them took."""
        train, streaming = self.train, isinstance(self.train, StreamShare)
        return {
            "streaming": streaming,
            "pad_id": self.tok.pad_id,
            "rows_total": None if streaming else train.total_rows,
            "rows_held": None if streaming else len(train.rows),
            "rows_read": train.rows_read if streaming else None,
            "bytes_held": train.nbytes,
            "rss_delta_bytes": rss_delta,
            "eval_rows_local": self.evals.real_rows if self.evals else 0,
            "eval_pad_rows_local": self.evals.pad_rows if self.evals else 0,
        }

    def vision_summary(self) -> dict[str, Any] | None:
        if self.vision is None:
            return None
        return {"arch": self.vision.arch, "image_token_id": self.vision.image_token,
                "image_per_row": self.vision.image_per_row, "image_token_counts": sorted(self.encoder.token_counts)}

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
