"""The soak's rank side: rounds of gradient-shaped all-reduces, for a hang rate
(``mlx-ddp-harness soak``).

Each round all-sums one float32 array of each gradient shape (one call each; a launch's last
round may take the first few only, so that the cell makes exactly its calls) on the job's stream,
evaluates them together and emits a ``step`` event: the watchdog's progress, and the round's
calls and time for the controller. A launch with a time limit (``seconds``, from its first
round) agrees with the other ranks how many rounds fit: after rounds 1, 2, 4, 8, ..., and again
when the agreed rounds are done, each rank estimates the rounds it can finish by then and the
ranks take the smallest (one ``all_min`` of an int32[1], not a call), so that every rank stops
after the same round. A planted stop (``SoakJob.stop``) cuts its round short so that its call
begins the next: the stopped rank's ledger then ends just before it, and the controller names
that rank and that call.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from harness.rank.context import RankContext
from harness.scenario.job import SoakJob


def gradient_shapes(job: SoakJob) -> list[tuple[int, ...]]:
    """The job's shapes, or its model's trainable parameters' (built with placeholder zeros,
    never evaluated: no weight is allocated and no RNG is drawn from)."""
    if job.shapes:
        return [tuple(s) for s in job.shapes]
    from mlx.utils import tree_flatten

    from harness.rank.models import model_config, text_architecture
    from harness.rank.weights import placeholder_init

    if job.config is not None:
        config = dict(job.config)
    elif job.model is not None:
        config = model_config(job.model, job.vocab_size)
    else:
        raise ValueError("the soak job names no shapes, config or model")
    arch = text_architecture(str(config["model_type"]))
    with placeholder_init():
        model = arch.Model(arch.ModelArgs.from_dict(config))
    return [tuple(p.shape) for _, p in tree_flatten(model.trainable_parameters())]


def _agreed_rounds(ctx: RankContext, stream: Any, rounds: int, started: float, until: float) -> int:
    """The rounds every rank can finish by ``until`` (the smallest of the ranks' estimates)."""
    import mlx.core as mx

    now = time.time()
    mine = rounds + max(0, int((until - now) / ((now - started) / rounds)))
    agreed = mx.distributed.all_min(mx.array([min(mine, 2**31 - 1)], dtype=mx.int32), group=ctx.group,
                                    stream=stream)
    return int(agreed.item())


def _cut_at_stop(job: SoakJob, first: int, k: int) -> int:
    """The round's calls, cut short where the planted stop falls inside it (every rank alike), so
    that the stop's call begins a round: the ranks complete every call before it."""
    stop = job.stop
    return stop.call - first if stop is not None and first < stop.call < first + k else k


def _stop_here(ctx: RankContext, job: SoakJob, first: int) -> None:
    """The planted hang: stop this rank before it issues the stop's call (which begins this round)."""
    stop = job.stop
    if stop is not None and stop.rank == ctx.rank and first == stop.call:
        ctx.events.emit("fault", rank=ctx.rank, phase="soak", action="sigstop", call=stop.call)
        os.kill(os.getpid(), signal.SIGSTOP)


def run(ctx: RankContext) -> dict[str, Any]:
    import mlx.core as mx

    job: SoakJob = ctx.job
    if job.calls is None and job.seconds is None:
        raise ValueError("the soak job has neither calls nor a time to stop by")
    shapes = gradient_shapes(job)
    stream = mx.cpu if job.stream == "cpu" else None
    grads = [mx.ones(s, dtype=mx.float32) for s in shapes]
    mx.eval(grads)
    ctx.phase("soak")  # progress for the watchdog: large gradients take a while to allocate
    width = len(grads)
    round_bytes = sum(g.nbytes for g in grads)
    timed: int | None = None  # the rounds the ranks agreed fit in the time
    done = rounds = 0
    next_plan, started = 1, time.time()
    until = started + (job.seconds or 0.0)
    while job.calls is None or done < job.calls:
        if timed is not None and rounds >= timed:  # the agreed rounds are done: does another fit?
            timed = _agreed_rounds(ctx, stream, rounds, started, until)
            if rounds >= timed:
                break
        first = job.first_call + done + 1
        k = _cut_at_stop(job, first, width if job.calls is None else min(width, job.calls - done))
        t0 = time.perf_counter()
        _stop_here(ctx, job, first)
        out = [mx.distributed.all_sum(g, group=ctx.group, stream=stream) for g in grads[:k]]
        mx.eval(out)
        took = time.perf_counter() - t0
        done, rounds = done + k, rounds + 1
        ctx.events.emit("step", step=rounds, rank=ctx.rank, calls=job.first_call + done, round_calls=k,
                        round_s=took, step_time_s=took, arrays=width, round_bytes=round_bytes)
        if job.seconds is not None and rounds == next_plan:
            timed = _agreed_rounds(ctx, stream, rounds, started, until)
            next_plan *= 2
    return {"calls": done, "rounds": rounds, "first_call": job.first_call, "arrays": width,
            "round_bytes": round_bytes, "stream": job.stream, "calls_s": time.time() - started}
