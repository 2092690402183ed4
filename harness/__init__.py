"""mlx-ddp-harness: launch real MLX DDP ranks, judge parity, memory and speed, and report.

Rooms: ``harness.controller`` (launch, watch, collect), ``harness.rank`` (the rank runtime every
trainer shares: entry, consensus, reporting, data, models), ``harness.trainers`` (the reference
trainer and the adapters of the trainers under test), ``harness.judge`` (checks, gates),
``harness.present`` (CLI, tables, reports).
``harness.schema`` is the one protocol that crosses the process boundary.
"""

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)
