"""mlx-lm's trainer under test: its record (``TRAINER``) and scenario rules; ``rank`` is the
adapter the ranks run."""

from __future__ import annotations

from harness.scenario.checks import CheckName
from harness.scenario.spec import RunSpec, Scenario, require
from harness.scenario.trainer_info import NO_TORCH, TrainerInfo


def rules(eff: Scenario, r: RunSpec, src: str, where: str) -> None:
    """mlx-lm's ``train``: no clipping, its own order, eval batches split across ranks."""
    require(eff.train.max_grad_norm == 0, src, f"{where}.train.max_grad_norm",
            "mlx-lm's trainer does not clip gradients: leave it at 0")
    require(eff.data.order == "ordered", src, f"{where}.data.order",
            "mlx-lm orders batches itself (rows sorted by length, batches in a seeded random order)")
    require(eff.data.rows >= eff.train.global_batch or eff.data.source == "jsonl", src, f"{where}.data.rows",
            "mlx-lm needs at least one global batch of rows")
    if eff.data.eval_rows or eff.data.eval_path:
        require(eff.train.eval_batch % r.world_size == 0, src, f"{where}.train.eval_batch",
                f"mlx-lm splits each eval batch across ranks: {eff.train.eval_batch} does not divide "
                f"by world_size {r.world_size}")


TRAINER = TrainerInfo(
    "mlx_lm", "mlx-lm's trainer (mlx_lm.tuner.trainer.train)", "harness.trainers.mlx_lm.rank", lora=True,
    resumes=True, rules=rules, probes=True,
    cpu_collectives="mlx-lm's trainer all-sums its reported losses and token counts on the CPU stream",
    saves="mlx-lm's trainer saves its adapter file on rank 0 after the last step", hides=NO_TORCH,
    package="mlx-lm", entry="mlx_lm.tuner.trainer.train",
    rank_loss_scale="each rank's loss is its own token mean (the mean of the ranks' means)",
    feeds_rows="the adapter calls its iterate_batches with the group it is given",
    # as scenarios/mlx_lm_mean_of_means.toml records it
    known_behaviour=("mlx-lm's loss and gradient are the mean of the ranks' mean losses, not weighted by tokens "
                     "(mlx-lm 0.32.2)",
                     {CheckName.step_loss_parity: 1.2e-4, CheckName.step_grad_parity: 5.7e-3,
                      CheckName.loss_parity: 9.5e-3, CheckName.param_parity: 0.155, CheckName.eval_parity: 2.6e-3}))
