"""One record per trainer under test (``TrainerInfo``): every fact the harness uses about a
trainer, from which validation, launching, judging and listing are derived.

Adding a trainer is one rank-side module with ``run(ctx) -> dict`` (it trains through the
trainer's public entry points and reports through ``harness.rank.reporter.StepReporter``) and
one record: in ``BUILTIN`` for a trainer shipped here, or, from another package, a ``TrainerInfo``
named by an entry point of the group ``mlx_ddp_harness.trainers`` (``toy = my_pkg.harness:INFO``).
The controller side never imports a trainer's module: the job file names it to the ranks
(``module``), and only ``resumes`` reaches into it, for ``check_resume_source``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

from harness.scenario import trainer_rules
from harness.scenario.spec import RunSpec, Scenario, ScenarioError

ENTRY_POINTS = "mlx_ddp_harness.trainers"
STEP_FAULTS = ("raise", "exit", "exit0", "sigkill", "segfault", "hang")  # what a trainer's own loop can take
MODELS = ("text", "vision", "any")


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
    LoRA adapters. ``resumes``:
    a later run can continue from its saves; its module has ``check_resume_source(path, step,
    scenario)``, called before anything starts. ``streams``: it reads an unsized stream of rows.
    ``rules``: its own scenario rules (``harness.scenario.trainer_rules``).

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
    baseline. ``package``: the distribution of the library it runs (a gate records its version;
    its import is a start-up cost the rank names). ``requires``: an optional package it needs
    (``install``: how to install it); where it is missing, the runs that need it are skipped,
    saying so (``harness.scenario.availability``).
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

    def __post_init__(self) -> None:
        if self.models not in MODELS:
            raise ValueError(f"trainer {self.kind!r}: models must be one of {MODELS}, got {self.models!r}")


NO_TORCH = ("torch", "torchvision")

BUILTIN = (
    TrainerInfo("reference", "the harness's reference DDP trainer", "harness.trainers.reference", models="any",
                external=False, resumes=True, streams=True, probes=True, twin=True,
                saves="the reference trainer saves its final parameters on rank 0", hides=NO_TORCH),
    TrainerInfo("mlx_lm", "mlx-lm's trainer (mlx_lm.tuner.trainer.train)", "harness.trainers.mlx_lm", lora=True,
                resumes=True, rules=trainer_rules.mlx_lm, probes=True,
                cpu_collectives="mlx-lm's trainer all-sums its reported losses and token counts on the CPU stream",
                saves="mlx-lm's trainer saves its adapter file on rank 0 after the last step", hides=NO_TORCH,
                package="mlx-lm"),
    TrainerInfo("mlx_vlm", "mlx-vlm's trainer (mlx_vlm.trainer.Trainer)", "harness.trainers.mlx_vlm",
                models="vision", lora=True, rules=trainer_rules.mlx_vlm, probes=True,
                cpu_collectives="mlx-vlm's trainer all-reduces its gradients and metrics on the CPU stream",
                saves="mlx-vlm's trainer saves its adapter file on rank 0 after the last step", hides=NO_TORCH,
                package="mlx-vlm"),
    TrainerInfo("unsloth_zoo", "unsloth-zoo's MLX trainer (unsloth_zoo.mlx.trainer)", "harness.trainers.unsloth_zoo",
                lora=True, streams=True, rules=trainer_rules.unsloth_zoo, probes=True,
                cpu_collectives="unsloth-zoo's MLX trainer all-sums its losses, token and row counts on the CPU stream",
                saves="unsloth-zoo's trainer saves its final adapters (or model) on rank 0",
                package="unsloth_zoo", requires="unsloth_zoo",
                install="pip install --no-deps 'unsloth_zoo>=2026.10.9'"),
    TrainerInfo("script", "a user's training script (reporting through harness.api)", "harness.trainers.script",
                script=True, probes=True),
    TrainerInfo("command", "any executable reporting through the rank protocol", "harness.trainers.command",
                command=True, rules=trainer_rules.command),
)

_registry: dict[str, TrainerInfo] = {}


def _load() -> dict[str, TrainerInfo]:
    """The built-in records, then those other packages declare (loaded once, on first use)."""
    if not _registry:
        for info in BUILTIN:
            _registry[info.kind] = info
        for ep in metadata.entry_points(group=ENTRY_POINTS):
            try:
                info = ep.load()
            except Exception as e:  # noqa: BLE001 - named, one line, where a scenario asks for it
                raise ScenarioError(f"trainer entry point {ep.name} = {ep.value}: cannot load it: "
                                    f"{type(e).__name__}: {e}") from e
            if not isinstance(info, TrainerInfo) or info.kind != ep.name:
                raise ScenarioError(f"trainer entry point {ep.name} = {ep.value}: not a TrainerInfo of kind "
                                    f"{ep.name!r}")
            register(info)
    return _registry


def register(info: TrainerInfo) -> TrainerInfo:
    """Add a trainer kind (a kind already registered is refused)."""
    known = _load()
    if info.kind in known and known[info.kind] is not info:
        raise ValueError(f"trainer kind {info.kind!r} is already registered ({known[info.kind].module})")
    known[info.kind] = info
    return info


def unregister(kind: str) -> None:
    _load().pop(kind, None)


def trainers() -> dict[str, TrainerInfo]:
    """Every registered trainer, by kind."""
    return dict(_load())


def kinds() -> tuple[str, ...]:
    return tuple(_load())


def trainer_info(kind: str) -> TrainerInfo:
    """The record of ``kind`` (KeyError for an unknown kind; scenarios are validated first)."""
    return _load()[kind]


def cpu_collectives(kind: str | None) -> str | None:
    """Why a trainer kind all-reduces on the CPU stream (None for the others and unknown kinds)."""
    info = _load().get(kind or "reference")
    return info.cpu_collectives if info is not None else None


def with_kind(flag: str) -> tuple[str, ...]:
    """The kinds whose record has ``flag`` set (for messages: "mlx_lm, reference can resume")."""
    return tuple(k for k, info in _load().items() if getattr(info, flag))


def versioned_packages() -> tuple[str, ...]:
    """What a gate records the version of: MLX, numpy and every trainer's package."""
    return tuple(sorted({"mlx", "numpy", *(t.package for t in trainers().values() if t.package)}))


def heavy_libraries() -> tuple[str, ...]:
    """Libraries whose import costs seconds: those trainers hide, transformers (mlx-lm and mlx-vlm
    import it) and every trainer's package, as imported."""
    names = [*(h for t in trainers().values() for h in t.hides), "transformers",
             *(t.package.replace("-", "_") for t in trainers().values() if t.package)]
    return tuple(dict.fromkeys(names))
