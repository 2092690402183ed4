"""The reference trainer's rank side, as every trainer's (``TrainerInfo.module``): ``run``, the
libraries every run loads, and the check of a checkpoint a run resumes from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.scenario import Scenario


def load_libraries(scenario: Scenario) -> None:
    """What every run imports beyond MLX: a vision-language model's mlx-vlm architecture (which
    imports transformers, and with it torch where that is installed)."""
    from harness.scenario.names import VLM_ARCHS

    arch = scenario.model.arch
    if arch in VLM_ARCHS:
        from harness.rank.weights import import_model_module

        import_model_module("mlx_vlm", arch)


def run(ctx: Any) -> dict[str, Any]:
    """Train the job's scenario on this rank (``harness.rank.entry`` calls it)."""
    from harness.trainers.reference.trainer import run as train

    return train(ctx)


def check_resume_source(source: Path, step: int | None, s: Any) -> None:
    """Before anything starts: the checkpoint in ``source`` to resume from (``step``'s, or the
    newest complete one) is complete and intact (``CheckpointError``, a ValueError, naming the
    file and what is wrong)."""
    from harness.trainers.reference.checkpoint import resolve, verify

    verify(resolve(source, step))
