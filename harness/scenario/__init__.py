"""A scenario: its file parsed into typed specs (``spec``, the values each key may take in
``names``), validated (``rules``, each trainer's own in its record: ``trainers``), and what it
means worked out once (``runs``, ``checks``, ``availability``)."""

from harness.scenario.load import discover, load_scenario, parse_scenario, with_device
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
