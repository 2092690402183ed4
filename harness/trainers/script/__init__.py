"""A user's training script under test: its record (``TRAINER``); ``rank`` runs the script in
each rank process."""

from __future__ import annotations

from harness.scenario.trainer_info import TrainerInfo

TRAINER = TrainerInfo("script", "a user's training script (reporting through harness.api)",
                      "harness.trainers.script.rank", script=True, probes=True, lora=True)
