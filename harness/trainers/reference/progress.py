"""The reference trainer's run so far: its per-step history, evals, digests and token counts,
where it started and how long it trained before. A checkpoint carries it (``resume``) besides
parameters and optimizer state; the rank's result reports it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HISTORY = ("losses", "step_times_s", "tok_s_local", "tok_s_global", "tokens_local_per_step", "grad_norms",
           "learning_rates", "tokens_global_per_step", "images_global_per_step", "img_s_global")
LOCAL_HISTORY = ("tokens_local_per_step", "tok_s_local", "step_times_s")  # this rank's own figures


@dataclass
class Progress:
    history: dict[str, list[Any]] = field(default_factory=lambda: {k: [] for k in HISTORY})
    evals: list[dict[str, Any]] = field(default_factory=list)
    digests: dict[int, str] = field(default_factory=dict)  # step -> parameter digest
    tokens_local: int = 0
    tokens_global: int = 0
    tokens_unattributed: int = 0  # restored at another world size: no current rank's
    images_local: int = 0
    start_step: int = 1
    train_time_before: float = 0.0  # trained before the checkpoint this run resumed from
    segments: list[dict[str, Any]] = field(default_factory=list)  # earlier runs' steps and world sizes

    def record(self, figures: dict[str, Any], local: int, tokens: int, images: int) -> None:
        """One optimizer step: its figures (a value for every ``HISTORY`` key) and its counts."""
        for key in HISTORY:
            self.history[key].append(figures[key])
        self.tokens_local += local
        self.tokens_global += tokens
        self.images_local += images

    def local_history(self) -> list[float]:
        """This rank's own figures, flat (every rank's are gathered into a checkpoint)."""
        return [v for key in LOCAL_HISTORY for v in self.history[key]]

    def result_fields(self, last: int, runtime: float, world_size: int) -> dict[str, Any]:
        """What the rank's result reports of the run so far, after training ended at ``last``."""
        return {
            **self.history,
            "tokens_local": self.tokens_local,
            "tokens_global": self.tokens_global,
            "tokens_local_unattributed": self.tokens_unattributed,
            "images_local": self.images_local,
            "images_global": sum(self.history["images_global_per_step"]),
            "train_time_s_total": self.train_time_before + runtime,
            "steps_start": self.start_step,
            "segments": [*self.segments, {"steps": [self.start_step, last], "world_size": world_size}],
            "digests": {str(k): v for k, v in self.digests.items()},
            "final_digest": self.digests[last],
            "evals": self.evals,
        }
