"""What a trainer under test provides, in one place: its record (``TrainerInfo``: every fact the
harness uses about a trainer, from which validation, launching, judging, listing and ``new`` are
derived) and its rank module (``TrainerModule``: what the ranks run, loaded by ``rank_module``).
Each built-in trainer's record is ``TRAINER`` in its own package (``harness.trainers.<kind>``),
beside its scenario rules; ``harness.scenario.trainers`` collects them."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from harness.scenario.spec import RunSpec, Scenario, require

STEP_FAULTS = ("raise", "exit", "exit0", "sigkill", "segfault", "hang")  # what a trainer's own loop can take
MODELS = ("text", "vision", "any")
NO_TORCH = ("torch", "torchvision")


@dataclass(frozen=True)
class TrainerInfo:
    """A trainer kind: where its rank side lives, what it can be given, and what the harness can
    measure of it.

    ``module``: the module the ranks import; its ``run(ctx)`` trains and returns the rank's
    result. ``models``: which models it trains (``text``, ``vision`` or ``any``). ``external``:
    it trains with its own code, which the harness does not change: no mutations and no input
    dropout, and faults only in the step phase (``STEP_FAULTS``, acted on when it reports a
    step); the reference trainer is the one that is not. ``script``: it runs a user's script
    (``[trainer] path``, ``args``, ``saves``). ``command``: it runs an executable (``path``,
    ``args``) that joins the distributed group itself and reports through the rank protocol
    (docs/rank-protocol.md); the rank process only feeds and reads it. ``lora``: it can train
    LoRA adapters. ``resumes``: a later run can continue from its saves; its module has
    ``check_resume_source(path, step, scenario)``, called before anything starts. ``streams``:
    it reads an unsized stream of rows. ``rules``: its own scenario rules (beside its record).

    ``probes``: it computes step-local probes at the reference's parameters through its own
    code (``StepReporter.probe``; otherwise the step-local checks are n/a). ``twin``: it can
    compute N ranks' shards in one process (the noise-floor twin); otherwise its trajectories
    are judged against *split* floor runs (``harness.scenario.runs``). ``cpu_collectives``: why it
    all-reduces on MLX's CPU stream, which only the ring backend serves on a CUDA machine (None:
    on the device, any backend). ``saves``: why it always saves on rank 0, so
    ``rank0_side_effects`` demands a save there (None: it promises none; a script declares its
    own). ``hides``: installed libraries it never calls but its dependencies import whenever
    they are present (transformers imports torch and torchvision: 8.5 s per rank on an H100);
    the rank marks them absent first (``harness.rank.entry.hide``). A module may define
    ``load_libraries(scenario)``: what it imports on every run, loaded before the rank's memory
    baseline, and ``warm_imports(scenario)``: what a warm-start server imports for it.
    ``package``: the distribution of the library it runs (a gate records its version;
    its import is a start-up cost the rank names). ``requires``: an optional package it needs
    (``install``: how to install it); where it is missing, the runs that need it are skipped,
    saying so (``harness.scenario.availability``).

    ``feeds_rows``: where its adapter hands the trainer its batch iterator, so that the
    ``same_rows`` mutation can tell the iterator every rank is rank 0 (None: it reads its rows
    itself).

    ``entry``: the library's own entry point its adapter calls (named in its failures and as its
    result's title; None: ``title``). ``known_behaviour``: its documented mean-of-means behaviour
    (docs/trainers.md): the reason, and the deviation each check measured in
    scenarios/<kind>_mean_of_means.toml (``new`` marks them expected failures where the rows show
    it). ``eval_batch_note``: why its ``eval_batch`` must be the training batch (``new`` then
    writes it). ``lora_layers_note``: why ``lora_layers`` must stay -1 (None: any count).
    """

    kind: str
    title: str
    module: str
    models: str = "text"
    external: bool = True
    script: bool = False
    command: bool = False
    lora: bool = False
    resumes: bool = False
    streams: bool = False
    rules: Callable[[Scenario, RunSpec, str, str], None] | None = None
    probes: bool = False
    twin: bool = False
    cpu_collectives: str | None = None
    saves: str | None = None
    hides: tuple[str, ...] = ()
    package: str | None = None
    requires: str | None = None
    install: str | None = None
    entry: str | None = None
    known_behaviour: tuple[str, dict[str, float]] | None = field(default=None, hash=False)
    eval_batch_note: str | None = None
    lora_layers_note: str | None = None
    feeds_rows: str | None = None
    rank_loss_scale: str | None = None

    def __post_init__(self) -> None:
        if self.models not in MODELS:
            raise ValueError(f"trainer {self.kind!r}: models must be one of {MODELS}, got {self.models!r}")


def even_slices(t: Any, r: RunSpec, src: str, where: str, who: str) -> int:
    """A trainer that gives every rank the same number of rows: each micro-step's rows (returned)
    must divide by the world size."""
    micro = t.global_batch // t.grad_accum
    require(micro % r.world_size == 0, src, f"{where}.world_size",
            f"{who}: the {micro} rows of each micro-step do not divide by world_size {r.world_size}")
    return micro


@runtime_checkable
class TrainerModule(Protocol):
    """A trainer's rank module (its record's ``module``): ``run(ctx)`` trains in one rank process
    (``ctx``: ``harness.rank.context.RankContext``) and returns the rank's result
    (``harness.schema.TrainResult``). The hooks it may define beside it are named in
    ``TrainerInfo``'s docstring (``load_libraries``, ``warm_imports``, ``check_resume_source``)."""

    def run(self, ctx: Any) -> dict[str, Any]: ...


def rank_module(name: str) -> TrainerModule:
    """The trainer's rank module ``name``, imported; ``TypeError`` naming it where it has no ``run``."""
    module = importlib.import_module(name)
    if not isinstance(module, TrainerModule):
        raise TypeError(f"trainer module {name} has no run(ctx): it cannot train in a rank")
    return module
