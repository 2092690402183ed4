"""unsloth-zoo's MLX trainer under test: its record (``TRAINER``) and scenario rules; ``rank`` is
the adapter the ranks run."""

from __future__ import annotations

from harness.scenario.spec import RunSpec, Scenario, require
from harness.scenario.trainer_info import TrainerInfo, even_slices

UNSLOTH_SCHEDULES = ("constant", "cosine")
UNSLOTH_ORDERS = ("ordered", "shuffled")


def rules(eff: Scenario, r: RunSpec, src: str, where: str) -> None:
    """unsloth-zoo's MLXTrainer: a per-rank batch, its own data order, its schedules."""
    t, d = eff.train, eff.data
    even_slices(t, r, src, where, "unsloth-zoo takes a per-rank batch")
    require(d.order in UNSLOTH_ORDERS, src, f"{where}.data.order",
            "unsloth-zoo takes 'ordered' (its sequential order: the scenario's rows in order) or 'shuffled' "
            "(its default, seeded order)")
    require(t.lr_schedule in UNSLOTH_SCHEDULES, src, f"{where}.train.lr_schedule",
            f"unsloth-zoo's schedules that match the scenario's are {', '.join(UNSLOTH_SCHEDULES)} "
            f"(its linear schedule decays to 0)")
    if d.eval_rows or d.eval_path:
        require(t.eval_batch % r.world_size == 0, src, f"{where}.train.eval_batch",
                f"unsloth-zoo takes a per-rank eval batch: {t.eval_batch} does not divide by world_size "
                f"{r.world_size}")


TRAINER = TrainerInfo(
    "unsloth_zoo", "unsloth-zoo's MLX trainer (unsloth_zoo.mlx.trainer)", "harness.trainers.unsloth_zoo.rank",
    lora=True, streams=True, rules=rules, probes=True,
    cpu_collectives="unsloth-zoo's MLX trainer all-sums its losses, token and row counts on the CPU stream",
    saves="unsloth-zoo's trainer saves its final adapters (or model) on rank 0",
    package="unsloth_zoo", requires="unsloth_zoo", install="pip install --no-deps 'unsloth_zoo>=2026.10.9'",
    entry="unsloth_zoo.mlx.trainer.MLXTrainer",
    rank_loss_scale="each micro-batch's loss is its own token mean, its gradient weighted by its tokens after")
