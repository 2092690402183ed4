"""Run one job end to end: make a run directory, launch, watch, collect, clean up."""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import schema
from harness.cluster_spec import Cluster, ClusterError
from harness.controller import launch as launcher
from harness.controller import rank_budget
from harness.controller.collect import STALLS, collect, ended_early, failure_reason
from harness.controller.cpu_use import CpuMeter
from harness.controller.devices import BackendRefused, DeviceRefused, accelerators, plan_backend, plan_device
from harness.controller.ledgers import desync
from harness.controller.outcome import RunOutcome, WatchReport
from harness.controller.params import load_stored, moved
from harness.controller.progress import Observer, ProgressFeed, RunProgress
from harness.controller.side_by_side import Cancelled
from harness.controller.watch import kill_group, watch
from harness.memory.guard import MemoryLimits
from harness.scenario.job import Job, TrainJob

INTERRUPTED = "INTERRUPTED"  # marks a kept run directory whose run was interrupted
KEEP_SUFFIXES = (".events.jsonl", ".collectives.jsonl", ".result.json", ".warm.json", ".callbacks.jsonl", ".stdout",
                 ".stderr", ".log")


class LaunchError(RuntimeError):
    """The ranks could not be started at all."""


def _why(e: BaseException) -> str:
    if isinstance(e, Cancelled):  # the controller's main thread was interrupted while this run went beside
        return _why(e.cause)
    if isinstance(e, KeyboardInterrupt):
        return "Ctrl-C"
    if isinstance(e, SystemExit) and isinstance(e.code, int) and e.code > 128:
        return f"signal {signal.Signals(e.code - 128).name}"
    return type(e).__name__


def _keep(run_dir: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in run_dir.iterdir():
        if f.is_file() and f.name.endswith(KEEP_SUFFIXES):
            shutil.copy2(f, dest / f.name)
        elif f.is_dir() and f.name.endswith(".protocol"):  # an executable's protocol files, not its weights
            shutil.copytree(f, dest / f.name, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)


def execute(
    name: str,
    job: Job,
    world_size: int,
    *,
    backend: str | None = None,
    wall_s: float = 600.0,
    no_progress_s: float = 120.0,
    keep_to: Path | None = None,
    progress: Observer | None = None,
    memory: MemoryLimits | None = None,
    cluster: Cluster | None = None,
    sync_dirs: tuple[Path, ...] = (),
    stop: Callable[[], None] | None = None,
) -> RunOutcome:
    """Launch ``job`` on ``world_size`` ranks and return what happened.

    The run directory lives under the system temp dir and is removed before returning; rank
    logs, events and results are copied to ``keep_to`` first when it is given. ``progress`` is
    shown the run's ``RunProgress`` as it goes (queued, each rank's phase and step, done).
    ``memory``: hard memory limits the watchdog enforces while the run goes. ``cluster``: hosts
    a run of more than one rank runs on (``cluster``'s docstring), ``sync_dirs`` the local
    directories its job names that the hosts read from and write to (the scenario's workspace).
    ``stop``: called while the run queues and at each poll of its watchdog; what it raises stops
    the run as an interruption does (``side_by_side``).
    """
    on_cluster = cluster is not None and world_size > 1
    scenario_name = job.scenario.name if job.scenario is not None else ""
    feed = ProgressFeed(RunProgress(scenario_name, name, world_size, job.steps), progress)
    device = _device(name, job, on_cluster)
    cpu = job.trainer.cpu_collectives if isinstance(job, TrainJob) else None
    backend, backend_reason = _backend(name, world_size, backend, cpu, on_cluster,
                                       (device or {}).get("planned") or "gpu")
    if device is not None:
        job = job.launched(device=device)
    try:
        feed.poll(False)  # queued
        # the watchdog starts once the ranks do; ranks on cluster hosts take no slots here
        expected = 0 if on_cluster else world_size * int(job.memory.get("expected_rank_bytes") or 0)
        slots = rank_budget.hold(0 if on_cluster else world_size, f"run {name!r}", memory_bytes=expected, stop=stop)
    except ValueError as e:
        raise LaunchError(str(e)) from e
    run_dir: Path | None = None
    try:
        run_dir = Path(tempfile.mkdtemp(prefix="mlx-ddp-harness-run-"))
        meter = CpuMeter()
        t_start = time.monotonic()
        if stop is not None:
            stop()
        started = _launch(name, job, world_size, backend, run_dir, cluster if on_cluster else None, sync_dirs)
        feed.start(run_dir)
        try:
            report = watch(started, wall_s, no_progress_s, meter, feed, memory, rank_budget.NeighbourMeter(slots),
                           stop)
        except BaseException as e:  # interrupted: leave no process behind, keep what the ranks wrote
            kill_group(started)
            if keep_to is not None:
                _keep(run_dir, keep_to)
                (keep_to / INTERRUPTED).write_text(
                    f"run {name!r} was interrupted ({_why(e)}) {time.monotonic() - t_start:.1f} s after its ranks "
                    f"started; its ranks' events, stdout and stderr up to then are here\n")
            raise
        finally:
            slots.release()
            if started.lease:
                started.lease.release()
        outcome = _summarize(name, run_dir, started, report, feed, job)
        outcome.backend_reason, outcome.queued_s = backend_reason, slots.waited_s
        outcome.ring_yield, outcome.warm_start = started.ring_yield, started.warm
        if device is not None:
            outcome.device, outcome.device_reason = device_used(outcome, device)
        if keep_to is not None:
            _keep(run_dir, keep_to)
            outcome.artifacts = keep_to
        return outcome
    finally:
        slots.release()
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)


def _device(name: str, job: Job, on_cluster: bool) -> dict[str, Any] | None:
    """The device a training job asks for, the one planned for it here and why (``plan_device``);
    on a cluster's hosts ``auto`` is each rank's default device."""
    asked = job.device.get("asked")
    if asked is None:
        return None
    if on_cluster:
        return {"asked": asked, "planned": None if asked == "auto" else asked,
                "reason": "auto: the hosts' default device" if asked == "auto" else None}
    try:
        planned, reason = plan_device(asked)
    except DeviceRefused as e:
        raise LaunchError(f"run {name!r}: {e}") from e
    return {"asked": asked, "planned": planned, "reason": reason}


def device_used(outcome: RunOutcome, plan: dict[str, Any]) -> tuple[str | None, str | None]:
    """The device the run's ranks computed on and why: as planned, unless their device check
    moved them to the CPU (``harness.rank.device_check``; every rank decides alike)."""
    for o in outcome.ranks:
        check = (o.result or {}).get("device_check") or {}
        if check.get("device"):
            return check["device"], o.result.get("device_reason")
    return plan["planned"], plan["reason"]


def _backend(name: str, world_size: int, backend: str | None, cpu_collectives: str | None,
             on_cluster: bool, device: str = "gpu") -> tuple[str | None, str | None]:
    """The run's backend and why, when the harness chose another than the usual one."""
    if on_cluster:  # the hosts' devices are theirs: ring unless the scenario or hostfile says
        return backend or "ring", None
    try:
        return plan_backend(world_size, backend, cpu_collectives=cpu_collectives, device=device)
    except BackendRefused as e:
        raise LaunchError(f"run {name!r}: {e}") from e


def _launch(name: str, job: Job, world_size: int, backend: str | None, run_dir: Path,
            cluster: Cluster | None, sync_dirs: tuple[Path, ...]) -> launcher.Launch:
    """Write the job into ``run_dir`` and start its ranks (here, or on ``cluster``'s hosts)."""
    # launched_at lets each rank measure its startup (launch to joined group) on one clock.
    placement = cluster.place(world_size) if cluster is not None else [0] * world_size  # rank -> its host
    acc = accelerators() if cluster is None else None  # a cluster host's GPUs are its own to count
    memory = {**job.memory, "ranks_on_host": [placement.count(h) for h in placement],
              "gpus_on_host": acc.count if acc is not None and acc.kind == "cuda" else None}
    job = job.launched(world_size=world_size, backend=backend, launched_at=time.time(), memory=memory)
    schema.write_json_atomic(run_dir / schema.JOB_FILE, schema.stamp(job.to_json()))
    try:
        if cluster is not None:
            assert backend is not None
            return launcher.start_on_cluster(run_dir, world_size, backend, cluster, list(sync_dirs))
        return launcher.start(run_dir, world_size, backend)
    except (OSError, ClusterError) as e:
        raise LaunchError(f"could not start ranks for run {name!r}: {e}") from e


def _summarize(name: str, run_dir: Path, started: launcher.Launch, report: WatchReport,
               feed: ProgressFeed, job: Job) -> RunOutcome:
    """What the ranks left in ``run_dir``: their results, the failure named, the final parameters
    (read where a check of the job's plan compares them: ``TrainJob.keep_params``)."""
    world_size = started.world_size
    ranks = collect(run_dir, world_size, report)
    failure = failure_reason(ranks, report)
    # a rank that left no result, or a run stopped at a time limit, may have waited in a collective
    stuck = report.limit in STALLS or any(o.result is None for o in ranks)
    # every run's ledgers compared: a divergence that did not hang is named too
    ended = {o.rank: (why, o.last_step) for o in ranks if (why := ended_early(o, report))}
    said = {r: f"{why} in step {step + 1}," if own else why for r, ((why, own), step) in ended.items()}
    collectives = desync(run_dir, world_size, said,
                         waiting=failure is not None and stuck, finished={o.rank for o in ranks if o.ok},
                         cut={r: step for r, ((_, own), step) in ended.items() if own})
    told = collectives is not None and collectives["agree"] is not None and (stuck or not collectives["agree"])
    if failure is not None and told:  # which collective the ranks disagree on, or all wait in
        failure += "\n" + collectives["line"]
    feed.finish("ok" if failure is None else failure.splitlines()[0])
    kept = failure is None and isinstance(job, TrainJob) and job.keep_params
    params, params_u = load_stored(schema.params_path(run_dir)) if kept else (None, None)
    return RunOutcome(
        name=name,
        world_size=world_size,
        backend=started.backend,
        ok=failure is None,
        failure=failure,
        ranks=ranks,
        watch=report,
        params=params,
        params_u=params_u,
        moved=moved(params, schema.start_params_path(run_dir)),
        hosts=[str(started.ranks.host_of(r)) for r in range(world_size)] if started.ranks.remote else None,
        collectives=collectives,
        notes=started.ranks.notes(),
    )
