"""The registry of trainers under test: it collects their records (``TrainerInfo``,
``harness.scenario.trainer_info``) and answers what the harness asks of them.

Adding a trainer is one package (or module) exposing its record as ``TRAINER`` and a rank-side
module with ``run(ctx) -> dict`` (it trains through the trainer's public entry points and reports
through ``harness.rank.reporter.StepReporter``): one line in ``BUILTIN`` for a trainer shipped
here, or, from another package, a ``TrainerInfo`` named by an entry point of the group
``mlx_ddp_harness.trainers`` (``toy = my_pkg.harness:INFO``). Records are imported by name, on
first use, and import only base modules. The controller side never imports a trainer's rank
module: the job file names it to the ranks (``module``), and only ``resumes`` reaches into it,
for ``check_resume_source``.
"""

from __future__ import annotations

import importlib
from importlib import metadata

from harness.scenario.spec import ScenarioError, TrainerSpec
from harness.scenario.trainer_info import MODELS, NO_TORCH, STEP_FAULTS, TrainerInfo

__all__ = ["BUILTIN", "ENTRY_POINTS", "MODELS", "NO_TORCH", "STEP_FAULTS", "TrainerInfo", "cpu_collectives",
           "heavy_libraries", "kinds", "register", "trainer_info", "trainers", "unregister", "versioned_packages",
           "with_kind"]

ENTRY_POINTS = "mlx_ddp_harness.trainers"
BUILTIN = (  # the modules whose TRAINER is a built-in record, in the order kinds are listed
    "harness.trainers.reference",
    "harness.trainers.mlx_lm",
    "harness.trainers.mlx_vlm",
    "harness.trainers.unsloth_zoo",
    "harness.trainers.script",
    "harness.trainers.command",
)

_registry: dict[str, TrainerInfo] = {}


def _load() -> dict[str, TrainerInfo]:
    """The built-in records, then those other packages declare (loaded once, on first use)."""
    if not _registry:  # filled only once every record loaded: a bad entry point is refused on every use
        found: dict[str, TrainerInfo] = {}
        for info in (importlib.import_module(name).TRAINER for name in BUILTIN):
            _add(found, info)
        for ep in metadata.entry_points(group=ENTRY_POINTS):
            try:
                info = ep.load()
            except Exception as e:  # noqa: BLE001 - named, one line, where a scenario asks for it
                raise ScenarioError(f"trainer entry point {ep.name} = {ep.value}: cannot load it: "
                                    f"{type(e).__name__}: {e}") from e
            if not isinstance(info, TrainerInfo) or info.kind != ep.name:
                raise ScenarioError(f"trainer entry point {ep.name} = {ep.value}: not a TrainerInfo of kind "
                                    f"{ep.name!r}")
            _add(found, info)
        _registry.update(found)
    return _registry


def _add(known: dict[str, TrainerInfo], info: TrainerInfo) -> None:
    if info.kind in known and known[info.kind] is not info:
        raise ValueError(f"trainer kind {info.kind!r} is already registered ({known[info.kind].module})")
    known[info.kind] = info


def register(info: TrainerInfo) -> TrainerInfo:
    """Add a trainer kind (a kind already registered is refused)."""
    _add(_load(), info)
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
    info = _load().get(kind or TrainerSpec.kind)
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
