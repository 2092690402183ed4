"""The machine's GPUs as MLX sees them, which device a run computes on (``plan_device``), and
which backend runs how many ranks on them.

NCCL needs one GPU per rank: ``mlx.launch --backend nccl`` gives rank r ``CUDA_VISIBLE_DEVICES=r``,
so a rank beyond the GPU count finds no device. The harness therefore refuses a run that asks for
nccl with more ranks than GPUs (before anything starts), and runs one that names no backend on the
ring backend instead, with the reason recorded in its result: ring ranks talk over loopback
sockets, so any number of them can share the GPUs (rank r on GPU r mod count). A trainer that
all-sums on MLX's CPU stream (``TrainerInfo.cpu_collectives``: mlx-lm's, mlx-vlm's,
unsloth-zoo's) runs on ring on a CUDA machine for the same kind of reason: nccl serves GPU
arrays only; so does a run on the CPU device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


class BackendRefused(ValueError):
    """A run's backend cannot run its world size on this machine."""


class DeviceRefused(ValueError):
    """A run asks for a device this machine does not have."""


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

    @property
    def paravirtual(self) -> bool:
        """A paravirtual Metal device ("Apple Paravirtual device": a GitHub-hosted macOS runner's
        M1 VM), where GPU work is unsupported and custom kernels were seen returning zeros."""
        return self.kind == "metal" and "paravirtual" in self.name.lower()

    def kind_line(self) -> str:
        """The device's kind in words, for ``doctor``."""
        if self.kind == "cpu":
            return "none: the CPU"
        if self.paravirtual:
            return "Metal (paravirtual: a hosted VM; auto uses the CPU)"
        return "CUDA" if self.kind == "cuda" else "Metal"

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


def plan_device(asked: str, acc: Accelerators | None = None) -> tuple[str, str | None]:
    """(``gpu`` or ``cpu``, why, where ``auto`` chose) for a run asking ``asked`` (``[train]
    device``); ``DeviceRefused`` for ``gpu`` where MLX sees none. ``auto`` takes a CUDA or real
    Metal GPU and the CPU where there is none or the Metal device is paravirtual. ``gpu`` on a
    paravirtual device is allowed: the ranks' device check (``harness.rank.device_check``) guards it."""
    if asked == "cpu":
        return "cpu", None
    acc = acc or accelerators()
    if asked == "gpu":
        if acc.kind == "cpu":
            raise DeviceRefused(f"device = \"gpu\", and MLX sees no GPU here ({acc.describe()}); use device = "
                                f"\"cpu\" or \"auto\"")
        return "gpu", None
    if asked != "auto":
        raise DeviceRefused(f"unknown device {asked!r} (auto, gpu or cpu)")
    if acc.kind == "cpu":
        return "cpu", "auto: no GPU here"
    if acc.paravirtual:
        return "cpu", (f"auto: the Metal device is paravirtual ({acc.name}, a hosted VM where GPU work is "
                       f"unsupported): the CPU")
    return "gpu", f"auto: {acc.count} x {acc.name} ({acc.kind})"


def plan_backend(world_size: int, requested: str | None, acc: Accelerators | None = None,
                 cpu_collectives: str | None = None, device: str = "gpu") -> tuple[str | None, str | None]:
    """(backend, why the harness chose it, or None when it is the one asked for or the usual
    default) of a run of ``world_size`` ranks on ``device`` (``plan_device``); ``BackendRefused``
    when it cannot run here. ``cpu_collectives``: why the trainer all-reduces on the CPU stream
    (``TrainerInfo``)."""
    if world_size == 1:
        return None, None
    acc = acc or accelerators()
    if acc.kind != "cuda":
        return requested or "ring", None
    if device == "cpu":
        if requested == "nccl":
            raise BackendRefused("device cpu: the nccl backend serves GPU arrays only; name no backend to run it "
                                 "on ring, or use device = \"gpu\"")
        return requested or "ring", (None if requested else "device cpu, which nccl cannot serve (GPU arrays "
                                                            "only): ring over loopback")
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
