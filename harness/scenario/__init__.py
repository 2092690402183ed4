"""A scenario: its file parsed into typed specs (``spec``, the values each key may take in
``names``), validated (``rules``, each trainer's own in its record: ``trainers``), and what it
means worked out once (``runs``, ``checks``, ``availability``)."""

from typing import Any

from harness.scenario.spec import (
    CheckSpec,
    DataSpec,
    FaultSpec,
    LimitSpec,
    ModelSpec,
    RunSpec,
    Scenario,
    ScenarioError,
    TrainerSpec,
    TrainSpec,
    writes_checkpoints,
)

__all__ = ["CheckSpec", "DataSpec", "FaultSpec", "LimitSpec", "ModelSpec", "RunSpec", "Scenario", "ScenarioError",
           "TrainSpec", "TrainerSpec", "discover", "load_scenario", "parse_scenario", "with_device",
           "writes_checkpoints"]


LOADER = ("discover", "load_scenario", "parse_scenario", "with_device")


def __getattr__(name: str) -> Any:
    """The loader's functions, imported at first use: a rank reads specs only, and the loader
    brings the rules and the trainer registry (``importlib.metadata``) with it."""
    if name in LOADER:
        from harness.scenario import load

        return getattr(load, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
