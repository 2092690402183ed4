"""mlx-ddp-harness: launch real MLX DDP ranks, judge parity, memory and speed, and report.

Rooms: ``harness.controller`` (launch, watch, collect), ``harness.rank`` (trainer, data,
models), ``harness.judge`` (checks), ``harness.present`` (CLI, tables, reports).
``harness.schema`` is the one protocol that crosses the process boundary.
"""

__version__ = "0.1.0"
