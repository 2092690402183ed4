"""An executable under test as every rank: its record (``TRAINER``) and scenario rules; ``rank``
feeds and reads it in each rank process."""

from __future__ import annotations

from harness.scenario.spec import RunSpec, Scenario, require
from harness.scenario.trainer_info import TrainerInfo


def rules(eff: Scenario, r: RunSpec, src: str, where: str) -> None:
    """An executable under the rank protocol: it is given each step's rows, one batch a step."""
    require(eff.train.grad_accum == 1, src, f"{where}.train.grad_accum",
            "a 'command' trainer is given one batch a step: leave grad_accum at 1")
    require(not eff.model.vision, src, "[model].arch", "a 'command' trainer is given token rows (a text model)")


TRAINER = TrainerInfo("command", "any executable reporting through the rank protocol",
                      "harness.trainers.command.rank", command=True, rules=rules)
