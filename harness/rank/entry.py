"""Rank entry point: ``python -m harness.rank RUN_DIR``.

Reads the job file, joins the distributed group (none for world size 1), announces itself with a
``start`` event, runs the job while a thread samples its memory (``harness.memory.sampler``) and
writes its result. A failure is written as an error result and
the process exits 1, so the controller learns the cause from the rank itself.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import ablation, schema
from harness.memory import share as memory_share
from harness.memory.sampler import (
    JOB_START,
    MemorySampler,
    accelerator,
    device_baseline_kind,
    peak_rss_bytes,
    rss_baseline_kind,
)
from harness.rank import device_check, ring_arrival
from harness.rank.collective_mutations import CollectiveMutation
from harness.rank.context import RECORD_DELAY_S, RankContext, ReportedFailure
from harness.rank.ledger import Ledger
from harness.rank.ledger import enabled as ledger_enabled
from harness.rank.startup import StartupClock
from harness.scenario.job import AnchorJob, Job, TrainJob, job_from_json
from harness.scenario.names import COLLECTIVE_MUTATIONS
from harness.scenario.trainer_info import NO_TORCH

TMPDIR_VAR = "MLX_DDP_HARNESS_TMPDIR"


def set_precision(job: Job) -> None:
    """A training job at ``[train] precision = "full"`` computes float32 matmuls at float32: MLX's
    CUDA backend otherwise rounds their operands to TF32 (read at the first matmul)."""
    if isinstance(job, TrainJob) and job.scenario.train.precision == "full":
        os.environ["MLX_ENABLE_TF32"] = "0"


def loads_first_step_kernels(accelerator_kind: str) -> bool:
    """Whether the warm-up also loads what a training job's first step would load lazily: only on
    a GPU whose RSS baseline is taken at job start (Metal). On CUDA the baseline is the end of
    step 1 (``harness.memory.sampler.rss_baseline_kind``), which holds them anyway: loading them
    earlier would be work the rank does and a bare process does not, for no figure."""
    return accelerator_kind != "cpu" and rss_baseline_kind(True, accelerator_kind == "cuda") == JOB_START


def warm_up(job: Job) -> None:
    """Bring MLX's device runtime up before the job, so that the rank's RSS baseline holds it.

    Everywhere: the device and its BLAS (a matmul). Where ``loads_first_step_kernels``, a
    training job also loads what its first step would load lazily and keep for the life of the
    process: the compiler of fused kernels, a compiled gradient in the model's dtype, and for a
    vision-language model the convolution library. Tiny arrays: milliseconds once loaded."""
    import mlx.core as mx

    warm = mx.ones((8, 8))
    mx.eval((warm @ warm).sum())
    if not isinstance(job, TrainJob) or not loads_first_step_kernels(accelerator()):
        return
    from harness.scenario.names import VLM_ARCHS

    model = job.scenario.model
    dtype = getattr(mx, model.built_dtype, mx.float32)
    w = mx.ones((8, 8), dtype=dtype)

    def loss(w: Any) -> Any:
        x = mx.fast.rms_norm(w @ w, mx.ones((8,), dtype=dtype), 1e-5)
        return mx.softmax(x.astype(mx.float32), axis=-1).sum()

    mx.eval(mx.compile(mx.grad(loss))(w))
    if model.arch in VLM_ARCHS:  # patch embeddings: 2-D (SigLIP) and 3-D (Qwen2-VL) convolutions
        for conv, x, k in ((mx.conv2d, (1, 4, 4, 3), (4, 2, 2, 3)), (mx.conv3d, (1, 2, 4, 4, 3), (4, 2, 2, 2, 3))):
            inputs = mx.ones(x, dtype=dtype)
            mx.eval(mx.grad(lambda k, conv=conv, inputs=inputs: conv(inputs, k).astype(mx.float32).sum())(
                mx.ones(k, dtype=dtype)))


def hide(names: tuple[str, ...]) -> None:
    """Mark top-level packages ``names`` absent in this process (``sys.modules[name] = None``):
    ``importlib.util.find_spec`` then finds nothing, so libraries that import them only when
    available skip them, and an ``import`` of one fails at once. A package already imported
    stays."""
    for name in names:
        sys.modules.setdefault(name, None)


ANCHOR_HEAVY = (*NO_TORCH, "transformers")  # what the speed anchor's libraries_loaded reports


def heavy(job: Job) -> tuple[str, ...]:
    """The libraries whose import costs seconds, which a job's start-up reports as loaded or not:
    its trainer's ``heavy``; for the speed anchor, mlx-lm's (``ANCHOR_HEAVY``)."""
    if isinstance(job, TrainJob):
        return job.trainer.heavy
    return ANCHOR_HEAVY if isinstance(job, AnchorJob) else ()


def hidden(job: Job) -> tuple[str, ...]:
    """The installed packages a job's rank marks absent (``hide``): its trainer's ``hides`` (with
    torch installed, transformers imports it, 0.6 GB of RSS per rank that no MLX trainer uses);
    for the speed anchor (``AnchorJob``: mlx-lm's step), torch, as the trainers it is timed beside
    hide it (importing mlx-lm otherwise brings it in, seconds of a rank's start where installed)."""
    if isinstance(job, TrainJob):
        return job.trainer.hides
    return NO_TORCH if isinstance(job, AnchorJob) else ()


def load_libraries(job: Job) -> None:
    """Import what a training job's trainer imports on every run (the job's trainer module's
    ``load_libraries(scenario)``), so that the rank's memory baseline holds the libraries, its
    ``hidden`` packages marked absent first. A library that fails to import is left to the
    trainer, which reports it in its own words."""
    hide(hidden(job))
    if isinstance(job, TrainJob):
        _trainer_hook(job, "load_libraries")


def warm_imports(job: Job) -> None:
    """What a warm-start server (``harness.rank.warm``) imports beyond ``load_libraries``: the
    modules the job's trainer imports later in a run (its module's ``warm_imports(scenario)``: rank
    0's final save, the rank protocol's validator), so that its forked ranks find them imported.
    A cold rank never calls it: its start-up figures stay those of the trainer's own imports."""
    if isinstance(job, TrainJob):
        _trainer_hook(job, "warm_imports")


def _trainer_hook(job: TrainJob, name: str) -> None:
    import importlib

    hook = getattr(importlib.import_module(job.trainer.module), name, None)
    if hook is not None:
        try:
            hook(job.scenario)
        except Exception:  # noqa: BLE001,S110 - reported by the trainer when it imports them itself
            pass


def job_runner(job: Job) -> Callable[[RankContext], dict[str, Any]]:
    """A ``train`` job runs the module of the trainer under test its job names; ``allsum``
    is the all-sum job (``harness.rank.allsum``), ``mlx_lm_step`` the speed anchor and ``grad_allreduce`` its all-reduce
    alone (``harness.rank.anchor``), ``soak`` the soak's
    all-reduces (``harness.rank.soak``)."""
    import importlib

    kind = job.kind
    if kind == "allsum":
        return importlib.import_module("harness.rank.allsum").run
    if kind == "mlx_lm_step":
        return importlib.import_module("harness.rank.anchor").run
    if kind == "grad_allreduce":
        return importlib.import_module("harness.rank.anchor").allreduce
    if kind == "soak":
        return importlib.import_module("harness.rank.soak").run
    from harness.scenario.trainer_info import rank_module

    return rank_module(job.trainer.module).run


def _init_group(run_dir: Path, rank: int, world_size: int, backend: str | None) -> tuple[Any, str]:
    import mlx.core as mx

    if world_size == 1:
        return mx.distributed.init(), "none"
    if not backend:
        raise ValueError("the job names no distributed backend")
    ring_arrival.meet(run_dir, rank, world_size, backend)
    return mx.distributed.init(strict=True, backend=backend), backend


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m harness.rank RUN_DIR", file=sys.stderr)
        return 2
    # mlx.launch's temp files live in the run dir; ranks go back to the real temp dir so MLX's
    # compile cache ($TMPDIR/mlx) is shared across runs.
    if TMPDIR_VAR in os.environ:
        os.environ["TMPDIR"] = os.environ[TMPDIR_VAR]
        tempfile.tempdir = None
    off = ablation.ablated()  # for benchmarks/observer_effect.py alone (names it does not know: none)
    alternated = ablation.alternating()  # for benchmarks/alternating_part.py alone
    if "faulthandler" not in off:
        faulthandler.enable()
        # The watchdog's SIGUSR1 dumps the main thread's stack (the trainer's loop). Not every
        # thread's: dumping a thread while it runs can crash the rank (faulthandler's own caveat).
        # It is sent to the main thread (harness.main_thread_signal), and the sampler thread blocks it.
        faulthandler.register(signal.SIGUSR1, all_threads=False)
    run_dir = Path(argv[0])
    rank = int(os.environ.get("MLX_RANK", "0"))
    events = schema.EventWriter(schema.events_path(run_dir, rank))
    result: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "job": "unknown"}
    sampler: MemorySampler | None = None
    share: memory_share.MemoryShare | None = None
    ledger: Ledger | None = None
    code = 0
    settle: Any = None  # an agreed failure's last collective, once the result is written (consensus)
    job: Any = None
    try:
        job = job_from_json(schema.read_json(run_dir / schema.JOB_FILE))
        result["job"] = job.kind
        clock = StartupClock(job.launched_at, heavy(job))
        set_precision(job)
        device_check.set_device(job)  # before the group and warm-up: every array of the rank lives there
        world_size = int(job.world_size or 1)
        own_group = isinstance(job, TrainJob) and job.trainer.own_group  # a command's processes join it
        mutation = job.mutation if isinstance(job, TrainJob) and job.mutation in COLLECTIVE_MUTATIONS else None
        if not own_group and (ledger_enabled() or mutation):  # every collective it issues, for the controller
            ledger = Ledger(schema.ledger_path(run_dir, rank), world_size, rank,
                            None if mutation is None else CollectiveMutation(mutation, rank, world_size, events.emit))
            ledger.install()
            events.listeners.append(ledger.on_event)
        group, backend = ((None, job.backend or "none") if own_group
                          else _init_group(run_dir, rank, world_size, job.backend))
        if group is not None and (group.size() != world_size or group.rank() != rank):
            raise RuntimeError(
                f"distributed group is rank {group.rank()} of {group.size()}, "
                f"expected rank {rank} of {world_size}"
            )
        import mlx.core as mx

        clock.done("device")
        if isinstance(job, TrainJob) and "device_check" not in off:  # a device that computes wrong is refused
            result.update(device_check.for_job(job, rank, world_size, group, backend, events))  # (auto: the CPU)
        if not own_group:  # every memory limit set in the rank is capped at its share (before any trainer import)
            share = memory_share.install(job, rank) if "memory_share" not in off else None
            if "warm_up" not in off:
                warm_up(job)
        clock.done("warm_up")
        startup_s = time.time() - float(job.launched_at or time.time())
        if "libraries" not in off:
            load_libraries(job)
        else:  # turned off by a benchmark: what the trainer hides stays hidden (hiding imports nothing)
            hide(hidden(job))
        clock.done("libraries")
        rss_runtime = peak_rss_bytes()  # what a rank holds before its job
        device = str(mx.default_device())
        sampler = MemorySampler(events, rank, rss_runtime, device_baseline_kind())
        events.emit("start", rank=rank, world_size=world_size, host=result["host"], pid=os.getpid(),
                    device=device, backend=backend, startup_s=startup_s, rss_runtime_bytes=rss_runtime,
                    **sampler.start_fields())
        if "sampler" in alternated:
            sampler.alternate(alternated["sampler"])
        if "ledger" in alternated and ledger is not None:
            ledger.alternate(alternated["ledger"])
        if "sampler" not in off:
            sampler.start()
        ctx = RankContext(run_dir, job, rank, world_size, group, backend, events, list(job.faults), memory=sampler,
                          startup=clock)
        payload = job_runner(job)(ctx)
        sampler.stop()
        result.update(status="ok", world_size=world_size, backend=backend, device=device,
                      is_main=rank == 0, accelerator=accelerator(), startup_s=startup_s,
                      rss_runtime_bytes=rss_runtime, **sampler.peaks(), **clock.figures(),
                      **sampler.figures(), **payload)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the controller
        code = 1
        # Agreed failures already say which rank failed and why; other errors carry their type.
        error = str(e) if isinstance(e, ReportedFailure) else f"{type(e).__name__}: {e}"
        result.update(status="error", error=error, traceback=traceback.format_exc(), **getattr(e, "result_fields", {}))
        traceback.print_exc()
        settle = getattr(e, "after_record", None)
    if share is not None:
        result["memory_share"] = share.to_json()
    if off:
        result["ablated"] = sorted(off)
    if alternated:
        result["alternated"] = alternated
    if sampler is not None:
        sampler.stop()
    events.emit("end", rank=rank, status=result["status"])
    events.close()
    if ledger is not None:
        ledger.uninstall()
    if any(f.rank == rank and f.phase == "record" for f in getattr(job, "faults", ())):
        time.sleep(RECORD_DELAY_S)  # the ``delay`` fault: a rank slow to write its result
    schema.write_json_atomic(schema.result_path(run_dir, rank), schema.stamp(result))
    if settle is not None:
        try:
            settle()
        except Exception:  # noqa: BLE001 - a peer already gone: the record is written, the exit stands
            pass
    return code
