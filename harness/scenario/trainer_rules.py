"""What each trainer under test can be given: the scenario rules of one trainer each, referred to
by its record (``harness.scenario.trainers.TrainerInfo.rules``). Each takes the run's effective
scenario, the run, the file and the run's key prefix, and raises ``ScenarioError`` naming them."""

from __future__ import annotations

from typing import Any

from harness.scenario.spec import RunSpec, Scenario, require

UNSLOTH_SCHEDULES = ("constant", "cosine")
UNSLOTH_ORDERS = ("ordered", "shuffled")


def even_slices(t: Any, r: RunSpec, src: str, where: str, who: str) -> int:
    """A trainer that gives every rank the same number of rows: each micro-step's rows (returned)
    must divide by the world size."""
    micro = t.global_batch // t.grad_accum
    require(micro % r.world_size == 0, src, f"{where}.world_size",
            f"{who}: the {micro} rows of each micro-step do not divide by world_size {r.world_size}")
    return micro


def mlx_lm(eff: Scenario, r: RunSpec, src: str, where: str) -> None:
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


def unsloth_zoo(eff: Scenario, r: RunSpec, src: str, where: str) -> None:
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


def mlx_vlm(eff: Scenario, r: RunSpec, src: str, where: str) -> None:
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
        require(t.eval_batch == micro, src, f"{where}.train.eval_batch",
                f"mlx-vlm evaluates in batches of the training batch size: set eval_batch = {micro}")
        require(d.eval_rows >= micro or d.eval_path is not None, src, f"{where}.data.eval_rows",
                f"mlx-vlm evaluates whole batches only: eval_rows must be at least {micro}")


def command(eff: Scenario, r: RunSpec, src: str, where: str) -> None:
    """An executable under the rank protocol: it is given each step's rows, one batch a step."""
    require(eff.train.grad_accum == 1, src, f"{where}.train.grad_accum",
            "a 'command' trainer is given one batch a step: leave grad_accum at 1")
    require(not eff.model.vision, src, "[model].arch", "a 'command' trainer is given token rows (a text model)")
