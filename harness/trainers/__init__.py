"""The trainers under test: one module each, all run inside the rank processes the controller
launches (``harness.rank.entry``), all reporting through the same rank protocol.

Adding a trainer: write ``harness/trainers/<kind>.py`` with ``run(ctx) -> dict`` (feed the
trainer the scenario's model, data and settings through its public entry points; report what it
did through ``harness.rank.reporter.StepReporter``), register it in ``TRAINERS`` and its kind in
``harness.scenario.TRAINER_KINDS``. Nothing else in the tree changes: the controller launches it
and the judge applies every check its results support (the others are reported as "n/a").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerInfo:
    """A trainer kind: its module, what it is, and what the harness can measure of it.

    ``probes``: it computes step-local probes at the reference's parameters through its own
    code (``StepReporter.probe``; otherwise the step-local checks are n/a). ``twin``: it can
    compute N ranks' shards in one process (the
    noise-floor twin); otherwise its trajectories are judged against *split* floor runs, the
    reference run again in one process with the model computing each batch in the N ranks' row
    chunks (``common.split_forward``: the same mathematics, N ranks' rounding; three draws of
    it, ``run_plan.SPLIT_SAMPLES``). Trainers that can
    resume are listed in ``harness.scenario_spec.RESUMING_TRAINERS`` and have
    ``check_resume_source(path, step, scenario)`` in their module. ``cpu_collectives``: why the
    trainer all-reduces on MLX's CPU stream, which only the ring backend serves on a CUDA machine
    (None: its collectives run on the device, any backend). A trainer module may define
    ``load_libraries(scenario)``: it imports what the trainer imports on every run, before the
    rank's memory baseline is taken (``harness.rank.entry.load_libraries``). ``saves``: why the
    trainer always saves on rank 0, so ``rank0_side_effects`` demands a save there (None: it
    promises none; a script declares its own with ``[trainer] saves``). ``hides``: installed
    libraries the trainer never calls but its dependencies import whenever they are present
    (transformers' image utilities import torch and torchvision: 8.5 s per rank on an H100);
    the rank marks them absent before the trainer's imports (``harness.rank.entry.hide``).
    ``requires``: an optional package the trainer needs (``install``: how to install it); where it
    is missing, the runs that need it are skipped, saying so (``harness.availability``)."""

    module: str
    title: str
    probes: bool = False
    twin: bool = False
    cpu_collectives: str | None = None
    saves: str | None = None
    hides: tuple[str, ...] = ()
    requires: str | None = None
    install: str | None = None


TRAINERS: dict[str, TrainerInfo] = {
    "reference": TrainerInfo("harness.trainers.reference", "the harness's reference DDP trainer", probes=True,
                             twin=True, saves="the reference trainer saves its final parameters on rank 0",
                             hides=("torch", "torchvision")),
    "mlx_lm": TrainerInfo("harness.trainers.mlx_lm", "mlx-lm's trainer (mlx_lm.tuner.trainer.train)", probes=True,
                          cpu_collectives="mlx-lm's trainer all-sums its reported losses and token counts on "
                                          "the CPU stream",
                          saves="mlx-lm's trainer saves its adapter file on rank 0 after the last step",
                          hides=("torch", "torchvision")),
    "mlx_vlm": TrainerInfo("harness.trainers.mlx_vlm", "mlx-vlm's trainer (mlx_vlm.trainer.Trainer)", probes=True,
                           cpu_collectives="mlx-vlm's trainer all-reduces its gradients and metrics on the "
                                           "CPU stream",
                           saves="mlx-vlm's trainer saves its adapter file on rank 0 after the last step",
                           hides=("torch", "torchvision")),
    "unsloth_zoo": TrainerInfo("harness.trainers.unsloth_zoo", "unsloth-zoo's MLX trainer (unsloth_zoo.mlx.trainer)",
                               probes=True,
                               cpu_collectives="unsloth-zoo's MLX trainer all-sums its losses, token and row "
                                               "counts on the CPU stream",
                               saves="unsloth-zoo's trainer saves its final adapters (or model) on rank 0",
                               requires="unsloth_zoo", install="pip install --no-deps 'unsloth_zoo>=2026.10.9'"),
    "script": TrainerInfo("harness.trainers.script", "a user's training script (reporting through harness.api)",
                          probes=True),
}


def trainer_info(kind: str) -> TrainerInfo:
    return TRAINERS[kind]


def cpu_collectives(kind: str | None) -> str | None:
    """Why a trainer kind all-reduces on the CPU stream (None for the others and unknown kinds)."""
    info = TRAINERS.get(kind or "reference")
    return info.cpu_collectives if info is not None else None
