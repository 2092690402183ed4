"""The device check: before a training job, every rank computes small known answers on its
device and compares them with numpy's, so a device that computes wrong (a paravirtual Metal
device's kernels were seen returning zeros) fails the run in one line instead of training on
garbage.

Three answers: a 64 x 64 matmul of integer-valued float32 matrices in [-8, 8] (exact in float32
and in TF32, which MLX on CUDA uses for float32 matmuls), a row sum of random floats (within a
rounding tolerance), and one ``all_sum`` across the ranks of a rank-dependent integer-valued
array (exact). The ranks then agree in one small all-sum (ok flag and first mismatch per rank),
so every rank decides alike: pass; under ``device = "auto"`` on a GPU, move to the CPU (checked
again there) and go on; otherwise fail, naming the device, the rank and the first mismatch.
Inputs come from ``np.random.default_rng``: the global numpy and MLX generators are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.rank.context import ReportedFailure
from harness.scenario.job import Job, TrainJob

SIZE = 64
ENTRY = 8  # matmul entries in [-ENTRY, ENTRY]: every product and partial sum is an exact float32 integer
ROW = 256  # the reduction's row length and the collective's array length
SEED = 20251126
TEXT_BYTES = 256
CHECKS = ("matmul", "reduction", "all_sum")


class DeviceCheckFailed(ReportedFailure):
    """The device computes wrong and the rank cannot leave it; ``result_fields``: the result's
    device fields (``harness.rank.entry`` writes them into the error result)."""

    def __init__(self, line: str, fields: dict[str, Any]):
        super().__init__(line)
        self.result_fields = fields


@dataclass
class Answers:
    """What a device (or numpy) computed; ``all_sum`` is None where no collective ran."""

    matmul: np.ndarray
    reduction: np.ndarray
    all_sum: np.ndarray | None = None


def inputs(seed: int = SEED) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The matmul's two matrices and the reduction's rows: the same on every rank."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-ENTRY, ENTRY + 1, (SIZE, SIZE)).astype(np.float32)
    b = rng.integers(-ENTRY, ENTRY + 1, (SIZE, SIZE)).astype(np.float32)
    x = rng.standard_normal((SIZE, ROW)).astype(np.float32)
    return a, b, x


def rank_array(rank: int) -> np.ndarray:
    """Rank ``rank``'s part of the collective: small integers, so any sum of them is exact."""
    return ((np.arange(ROW) % 17) + 3 * rank + 1).astype(np.float32)


def expected(world_size: int | None, seed: int = SEED) -> Answers:
    """numpy's answers (``world_size`` None: no collective)."""
    a, b, x = inputs(seed)
    total = None if world_size is None else np.sum([rank_array(r) for r in range(world_size)], axis=0)
    return Answers(a @ b, x.astype(np.float64).sum(axis=1).astype(np.float32), total)


def compute(rank: int, group: Any, collective: bool, wrong: bool = False, seed: int = SEED) -> Answers:
    """MLX's answers on its default device; ``wrong`` (the ``wrong_result`` fault) zeros the matmul.
    The collective goes first: a local error then cannot leave a peer waiting in it."""
    import mlx.core as mx

    total = None
    if collective:
        total = mx.distributed.all_sum(mx.array(rank_array(rank)), group=group)
        mx.eval(total)
    a, b, x = (mx.array(v) for v in inputs(seed))
    product, rows = a @ b, x.sum(axis=1)
    mx.eval(product, rows)
    got = Answers(np.array(product), np.array(rows), None if total is None else np.array(total))
    if wrong:
        got.matmul = np.zeros_like(got.matmul)
    return got


def _mismatch(name: str, got: np.ndarray, want: np.ndarray, tol: np.ndarray | float = 0.0) -> str | None:
    """One line for the first element of ``got`` that differs from ``want`` by more than ``tol``."""
    if got.shape != want.shape:
        return f"{name}: shape {list(got.shape)}, expected {list(want.shape)}"
    bad = ~(np.abs(got.astype(np.float64) - want.astype(np.float64)) <= tol)  # NaN is bad
    if not bad.any():
        return None
    at = tuple(int(i) for i in np.argwhere(bad)[0])
    return (f"{name}: {int(bad.sum())} of {bad.size} elements differ (expected {want[at]:.6g}, got {got[at]:.6g} "
            f"at {list(at)})")


def compare(got: Answers, want: Answers) -> list[str]:
    """One line per answer that is wrong (empty: every answer is right). The matmul and the
    collective are exact; a row sum may differ by float32 rounding of its 256 terms."""
    _, _, x = inputs()
    tol = 1e-5 * np.abs(x.astype(np.float64)).sum(axis=1) + 1e-6
    found = [_mismatch("matmul", got.matmul, want.matmul), _mismatch("reduction", got.reduction, want.reduction, tol)]
    if want.all_sum is not None:
        found.append("all_sum: no result" if got.all_sum is None else _mismatch("all_sum", got.all_sum, want.all_sum))
    return [m for m in found if m is not None]


def agree(first: str | None, rank: int, world_size: int, group: Any, backend: str) -> dict[int, str]:
    """Every rank's first mismatch (rank -> line), on every rank: one all-sum of a flag and the
    text per rank, on the CPU stream unless the backend is nccl (GPU arrays only)."""
    if world_size == 1:
        return {0: first} if first else {}
    import mlx.core as mx

    buf = np.zeros((world_size, 1 + TEXT_BYTES), dtype=np.int32)
    if first:
        raw = first.encode("utf-8")[:TEXT_BYTES]
        buf[rank, 0] = 1
        buf[rank, 1 : 1 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    stream = {} if backend == "nccl" else {"stream": mx.cpu}
    total = np.array(mx.distributed.all_sum(mx.array(buf), group=group, **stream))
    return {r: bytes(row[1:][row[1:] > 0].astype(np.uint8)).decode("utf-8", errors="replace")
            for r, row in enumerate(total) if row[0]}


def device_label(device: str) -> str:
    """``gpu (Apple Paravirtual device)``, or ``cpu``."""
    import mlx.core as mx

    if device == "cpu":
        return "cpu"
    try:
        name = mx.device_info(mx.gpu).get("device_name")
    except Exception:  # noqa: BLE001 - device_info is not on every build
        name = None
    return f"gpu ({name})" if name else "gpu"


def failure_line(device: str, failed: dict[int, str], rank: int) -> str:
    """What a rank says when the check failed on ``failed``'s ranks: its own mismatch, or the first peer's."""
    if rank in failed:
        others = sorted(set(failed) - {rank})
        also = f" (and on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
        return f"device {device} computes wrong on rank {rank}: {failed[rank]}{also}"
    first = min(failed)
    return f"a peer rank failed: device {device} computes wrong on rank {first}: {failed[first]}"


def set_device(job: Job) -> None:
    """Put this rank's work on the device its job planned (none planned: MLX's default)."""
    import mlx.core as mx

    planned = job.device.get("planned")
    if planned in ("gpu", "cpu"):
        mx.set_default_device(mx.gpu if planned == "gpu" else mx.cpu)


def current() -> str:
    import mlx.core as mx

    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def _problems(rank: int, world_size: int, group: Any, collective: bool, wrong: bool = False) -> list[str]:
    """This rank's mismatches on its device now; an error is one (a device that cannot compute
    computes wrong), so every rank goes on to the agreement whatever happened here."""
    try:
        return compare(compute(rank, group, collective, wrong), expected(world_size if collective else None))
    except Exception as e:  # noqa: BLE001 - said in the agreement
        return [f"{type(e).__name__}: {e}"]


def check(asked: str, rank: int, world_size: int, group: Any, backend: str,
          wrong: bool = False) -> tuple[dict[str, Any], str | None]:
    """Run the check on every rank of a job that asked for device ``asked``: (the result's
    ``device_check`` record, why the rank moved to the CPU, or None); ``ReportedFailure`` where
    the device computes wrong and cannot be left."""
    import mlx.core as mx

    device = current()
    collective = world_size > 1
    record: dict[str, Any] = {"device": device, "checks": list(CHECKS if collective else CHECKS[:2])}
    problems = _problems(rank, world_size, group, collective, wrong)
    failed = agree(problems[0] if problems else None, rank, world_size, group, backend)
    if not failed:
        return {**record, "status": "passed", "detail": None}, None
    label = device_label(device)
    line = failure_line(label, failed, rank)
    detail = failed[rank] if rank in failed else failed[min(failed)]
    record.update(status="failed", detail=detail)
    fields = {"device_check": record}
    if device == "gpu" and asked == "auto" and backend == "nccl":
        raise DeviceCheckFailed(f"{line}; the nccl backend serves GPU arrays only, so its ranks cannot move to the "
                                f"CPU: run with device = \"cpu\" (on ring)", fields)
    if device == "gpu" and asked == "auto":
        mx.set_default_device(mx.cpu)
        again = _problems(rank, world_size, group, collective)
        if agree(again[0] if again else None, rank, world_size, group, backend):
            raise DeviceCheckFailed(f"{line}, and the CPU computes wrong too", fields)
        name = label[3:].strip()
        reason = f"auto: the GPU{' ' + name if name else ''} computed wrong ({detail}): the CPU"
        return {**record, "status": "fell_back", "device": "cpu"}, reason
    raise DeviceCheckFailed(line + ('; run with device = "cpu"' if device == "gpu" else ""), fields)


def for_job(job: TrainJob, rank: int, world_size: int, group: Any, backend: str,
            events: Any) -> dict[str, Any]:
    """A training job's device fields of the rank's result (``device_asked``, ``device_reason``,
    ``device_check``), after checking its device; a command trainer's executable computes in a
    process of its own, so its check is skipped, saying so."""
    plan = job.device
    fields = {"device_asked": plan.get("asked", "auto"), "device_reason": plan.get("reason")}
    if job.trainer.own_group:
        why = "a command trainer computes in its own process (given the device in MLX_DDP_HARNESS_DEVICE)"
        return {**fields, "device_check": {"device": current(), "checks": [], "status": "skipped", "detail": why}}
    wrong = [f for f in job.faults if f.rank == rank and f.phase == "device_check"]
    if wrong:
        events.emit("fault", rank=rank, step=wrong[0].step, phase="device_check", action=wrong[0].action)
    try:
        record, moved = check(job.device.get("asked", "auto"), rank, world_size, group, backend, wrong=bool(wrong))
    except DeviceCheckFailed as e:
        e.result_fields = {**fields, **e.result_fields}
        raise
    return {**fields, "device_check": record, "device_reason": moved or fields["device_reason"]}


def main(argv: list[str]) -> int:
    """``python -m harness.rank.device_check gpu|cpu``: the check in this process alone (no
    collective), one JSON line: the device and its mismatches (``doctor``)."""
    import json

    import mlx.core as mx

    device = argv[0] if argv else current()
    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    try:
        problems = compare(compute(0, None, False), expected(None))
    except Exception as e:  # noqa: BLE001 - said in the line
        problems = [f"{type(e).__name__}: {e}"]
    print(json.dumps({"device": device_label(device), "checks": list(CHECKS[:2]), "problems": problems}))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
