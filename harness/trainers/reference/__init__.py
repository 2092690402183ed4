"""The harness's reference DDP trainer: its record (``TRAINER``) is here; ``rank`` is what the
ranks run (``run``); ``trainer`` is its loop (start there); ``batching`` shards each global batch
across ranks; ``step`` is the local step (compiled or eager); ``semantics`` holds the DDP
arithmetic a mutation can break; ``evaluate`` is sharded evaluation; ``checkpoint`` and ``resume``
write, verify and restore its checkpoints.

It runs on the rank runtime every trainer shares (``harness.rank``: entry, protocol, consensus,
digests, memory, faults) and reads the same models and data as the adapters do.
"""

from __future__ import annotations

from harness.scenario.trainer_info import NO_TORCH, TrainerInfo

TRAINER = TrainerInfo("reference", "the harness's reference DDP trainer", "harness.trainers.reference.rank",
                      models="any", external=False, resumes=True, streams=True, probes=True, twin=True,
                      saves="the reference trainer saves its final parameters on rank 0", hides=NO_TORCH)
