"""The machine's GPUs as MLX sees them, and which backend runs how many ranks on them.

NCCL needs one GPU per rank: ``mlx.launch --backend nccl`` gives rank r ``CUDA_VISIBLE_DEVICES=r``,
so a rank beyond the GPU count finds no device. The harness therefore refuses a run that asks for
nccl with more ranks than GPUs (before anything starts), and runs one that names no backend on the
ring backend instead, with the reason recorded in its result: ring ranks talk over loopback
sockets, so any number of them can share the GPUs (rank r on GPU r mod count). A trainer that
all-sums on MLX's CPU stream (``TrainerInfo.cpu_collectives``: mlx-lm's, mlx-vlm's,
unsloth-zoo's) runs on ring on a CUDA machine for the same kind of reason: nccl serves GPU
arrays only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


class BackendRefused(ValueError):
    """A run's backend cannot run its world size on this machine."""


@dataclass(frozen=True)
class Accelerators:
    """What MLX computes on here: ``kind`` is cuda, metal or cpu; ``count`` GPUs (0 for cpu)."""

    kind: str
    count: int
    name: str
    memory_bytes: int | None = None  # per GPU

    def describe(self) -> str:
        if self.kind == "cpu":
            return f"none: MLX computes on the CPU ({self.name})"
        memory = f", {self.memory_bytes / 2**30:.0f} GiB each" if self.memory_bytes else ""
        return f"{self.count} x {self.name} ({self.kind}{memory})"

    def ranks_per_backend(self, available: list[str]) -> str:
        """Which backend can run how many ranks here, in words."""
        parts = []
        for b in available:
            if b == "nccl":
                parts.append(f"nccl: up to {self.count} ranks (one per GPU)" if self.kind == "cuda"
                             else "nccl: none (needs CUDA GPUs)")
            elif b == "ring" and self.kind == "cuda":
                parts.append(f"ring: any number (ranks share the {self.count} GPUs over loopback)")
            else:
                parts.append(f"{b}: any number")
        return "; ".join(parts)


@functools.lru_cache(maxsize=1)
def accelerators() -> Accelerators:
    import mlx.core as mx

    if mx.cuda.is_available():
        kind, count = "cuda", int(mx.device_count(mx.gpu))
    elif mx.metal.is_available():
        kind, count = "metal", 1
    else:
        kind, count = "cpu", 0
    try:
        info = mx.device_info(mx.gpu if count else mx.cpu)
    except Exception:  # device_info is not on every build
        info = {}
    memory = info.get("total_memory") or info.get("memory_size")
    return Accelerators(kind, count, str(info.get("device_name") or kind), int(memory) if memory else None)


def plan_backend(world_size: int, requested: str | None, acc: Accelerators | None = None,
                 cpu_collectives: str | None = None) -> tuple[str | None, str | None]:
    """(backend, why the harness chose it, or None when it is the one asked for or the usual
    default) of a run of ``world_size`` ranks; ``BackendRefused`` when it cannot run here.
    ``cpu_collectives``: why the trainer all-reduces on the CPU stream (``TrainerInfo``)."""
    if world_size == 1:
        return None, None
    acc = acc or accelerators()
    if acc.kind != "cuda":
        return requested or "ring", None
    if cpu_collectives and requested in (None, "nccl"):
        if requested == "nccl":
            raise BackendRefused(f"{cpu_collectives}, which the nccl backend cannot serve (GPU arrays only); "
                                 "name no backend to run it on ring")
        return "ring", (f"{cpu_collectives}, which nccl cannot serve: ring over loopback, rank r on GPU "
                        f"r mod {acc.count}")
    if requested == "nccl" and world_size > acc.count:
        raise BackendRefused(f"world size {world_size} needs {world_size} GPUs with the nccl backend (one per "
                             f"rank) and this machine has {acc.count}; name no backend to run it on ring")
    if requested is not None:
        return requested, None
    if world_size <= acc.count:
        return "nccl", None
    return "ring", (f"{world_size} ranks on {acc.count} GPUs: nccl needs one GPU per rank, so ring over "
                    f"loopback, rank r on GPU r mod {acc.count}")
