"""mlx-vlm's trainer under test: its record (``TRAINER``) and scenario rules; ``rank`` is the
adapter the ranks run."""

from __future__ import annotations

from harness.scenario.checks import CheckName
from harness.scenario.spec import RunSpec, Scenario, require
from harness.scenario.trainer_info import NO_TORCH, TrainerInfo, even_slices

EVAL_BATCH = "mlx-vlm evaluates in batches of the training batch size"
LORA_LAYERS = "mlx-vlm adapts every layer it finds: keep -1"


def rules(eff: Scenario, r: RunSpec, src: str, where: str) -> None:
    """mlx-vlm's Trainer: whole per-rank slices, its own order, no clipping, eval batches of the
    training batch size, a step it compiles or not."""
    t, d = eff.train, eff.data
    micro = even_slices(t, r, src, where, "mlx-vlm splits each batch into equal rank slices")
    require(t.max_grad_norm == 0, src, f"{where}.train.max_grad_norm",
            "mlx-vlm's trainer does not clip gradients: leave it at 0")
    require(d.order == "ordered", src, f"{where}.data.order",
            "mlx-vlm orders batches itself (rows grouped by media and sorted by length, batches in a seeded order)")
    require(t.compile in ("off", "strict"), src, f"{where}.train.compile",
            "mlx-vlm compiles its whole step or not at all (no fallback): use 'off' or 'strict'")
    require(eff.trainer.lora_layers == -1, src, f"{where}.trainer.lora_layers",
            "mlx-vlm's LoRA adapts every transformer layer it finds: leave lora_layers at -1")
    require(d.rows >= micro or d.source == "jsonl", src, f"{where}.data.rows",
            "mlx-vlm needs at least one global batch of rows")
    if d.eval_rows or d.eval_path:
        require(t.eval_batch == micro, src, f"{where}.train.eval_batch", f"{EVAL_BATCH}: set eval_batch = {micro}")
        require(d.eval_rows >= micro or d.eval_path is not None, src, f"{where}.data.eval_rows",
                f"mlx-vlm evaluates whole batches only: eval_rows must be at least {micro}")


TRAINER = TrainerInfo(
    "mlx_vlm", "mlx-vlm's trainer (mlx_vlm.trainer.Trainer)", "harness.trainers.mlx_vlm.rank",
    models="vision", lora=True, rules=rules, probes=True,
    cpu_collectives="mlx-vlm's trainer all-reduces its gradients and metrics on the CPU stream",
    saves="mlx-vlm's trainer saves its adapter file on rank 0 after the last step", hides=NO_TORCH,
    package="mlx-vlm", entry="mlx_vlm.trainer.Trainer", eval_batch_note=EVAL_BATCH, lora_layers_note=LORA_LAYERS,
    feeds_rows="the adapter calls its iterate_vlm_batches, which takes the rank it shards for",
    rank_loss_scale="each rank's loss is its own token mean (its gradient the mean of the ranks')",
    # as scenarios/mlx_vlm_mean_of_means.toml records it
    known_behaviour=("mlx-vlm's gradient is the mean of the ranks' mean-loss gradients, not weighted by tokens "
                     "(mlx-vlm 0.7.10)",
                     {CheckName.step_grad_parity: 0.142, CheckName.loss_parity: 6.0e-3,
                      CheckName.param_parity: 2.7e-2, CheckName.eval_parity: 9.5e-4}))
