"""The scenario's optimizer, built the same way for every trainer that takes an MLX optimizer
(the reference trainer, mlx-lm's, mlx-vlm's and a script's through ``harness.api``)."""

from __future__ import annotations

from typing import Any

from harness.scenario import TrainSpec


def build_optimizer(spec: TrainSpec, lr: float | None = None) -> Any:
    """The scenario's optimizer (AdamW, or plain SGD) with its learning-rate schedule (warmup, then
    constant/cosine/linear) and weight decay; ``lr`` replaces the spec's peak learning rate."""
    import mlx.optimizers as optim

    lr = spec.learning_rate if lr is None else lr
    decay_steps = max(1, spec.steps - spec.warmup_steps)
    end = lr * spec.min_lr_ratio
    if spec.lr_schedule == "cosine":
        schedule: Any = optim.cosine_decay(lr, decay_steps, end)
    elif spec.lr_schedule == "linear":
        schedule = optim.linear_schedule(lr, end, decay_steps)
    else:
        schedule = lr
    if spec.warmup_steps:
        after = schedule if callable(schedule) else optim.linear_schedule(lr, lr, 1)
        schedule = optim.join_schedules([optim.linear_schedule(0.0, lr, spec.warmup_steps), after],
                                        [spec.warmup_steps])
    if spec.optimizer == "sgd":
        return optim.SGD(learning_rate=schedule, weight_decay=spec.weight_decay)
    return optim.AdamW(learning_rate=schedule, weight_decay=spec.weight_decay)
