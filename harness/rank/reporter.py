"""What an external trainer did, step by step, in the reference trainer's result schema.

An adapter (``harness.trainers``) or a user's script (through ``harness.api``) calls
``step`` once per optimizer step with the loss and token counts the trainer itself computed,
``eval`` for each evaluation, ``saved`` for each file the trainer writes, and ``finish`` with the
final parameters. The reporter adds what every rank result carries (per-step timings and tok/s,
replica digests every ``digest_every`` steps, MLX memory and RSS from the rank's memory sampler,
which takes a CUDA rank's RSS baseline at the end of its first step (``harness.memory.sampler``),
faults injected at the scenario's steps), writes the ``step`` and ``eval`` events the watchdog and
the progress lines read, and builds the result the judge reads. Checks the trainer cannot
support are named in ``not_applicable`` (check name -> why) and reported as "n/a".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from harness import schema
from harness.rank import turns
from harness.rank.context import RankContext, ReportedFailure
from harness.rank.models import param_count, start_digest, tree_digest
from harness.scenario import Scenario


def global_rng_states() -> dict[str, str]:
    """A digest of each global RNG's state, numpy's and MLX's: training must leave both untouched."""
    import hashlib

    import mlx.core as mx
    import numpy as np

    return {"numpy": hashlib.sha256(np.random.get_state()[1].tobytes()).hexdigest(),
            "mlx": hashlib.sha256(np.array(mx.random.state[0]).tobytes()).hexdigest()}


def rng_changes(before: dict[str, str]) -> dict[str, Any]:
    """The result's fields for the global RNGs changed since ``before`` (``global_rng_states``)."""
    changed = [name for name, state in global_rng_states().items() if before.get(name) != state]
    return {"global_rng_untouched": not changed, "global_rng_changed": changed}


HISTORY = ("losses", "step_times_s", "tok_s_local", "tok_s_global", "tokens_local_per_step", "learning_rates",
           "tokens_global_per_step")


def send_from_rank0(ctx: RankContext, value: Any) -> Any:
    """Rank 0's JSON-able ``value`` on every rank (two all-sums; the value itself in one process)."""
    if ctx.world_size == 1:
        return value
    import json

    import mlx.core as mx
    import numpy as np

    raw = json.dumps(value).encode() if ctx.rank == 0 else b""
    size = int(mx.distributed.all_sum(mx.array(len(raw), dtype=mx.int32), group=ctx.group).item())
    buf = np.zeros(size, dtype=np.int32)
    buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    total = np.array(mx.distributed.all_sum(mx.array(buf), group=ctx.group))
    return json.loads(bytes(total.astype(np.uint8)).decode())


class StepReporter:
    """Collects one rank's report of an external trainer's run (see the module docstring)."""

    def __init__(self, ctx: RankContext, s: Scenario, not_applicable: dict[str, str] | None = None,
                 compile_scope: str = "none"):
        import psutil

        from harness.rank.effects import MainRankEffects
        from harness.rank.step_probe import Probes

        self.ctx, self.s = ctx, s
        self.name = f"trainer {s.trainer.kind}"
        self.not_applicable = dict(not_applicable or {})
        self.compile_scope = compile_scope
        self.fallback_reason: str | None = None  # why a compiled trainer fell back to eager
        self.effects = MainRankEffects(ctx.run_dir, ctx.rank, ctx.job.keep_start, ctx.job.keep_params)
        self.proc = psutil.Process()
        self.history: dict[str, list[Any]] = {k: [] for k in HISTORY}
        self.evals: list[dict[str, Any]] = []
        self.digests: dict[int, str] = {}
        self.saves = 0
        self.rss_peak = self.proc.memory_info().rss
        self.rng_before = global_rng_states()
        self.rng_from_start = False  # snapshot the global RNGs again when training starts (a script's)
        self.t_start = self.t_last = time.perf_counter()
        self.data_bytes = 0
        self.stream: Any = None  # the trainer reads its rows lazily from this (``rows_read``)
        self.from_rank0: dict[str, Any] | None = None
        self.finished: dict[str, Any] | None = None
        self.done = 0  # steps trained before this run: it resumed after them
        self.resume: dict[str, Any] | None = None
        self.probes = Probes(ctx.job.probe)
        self.probe_s = 0.0  # probe (and turn) time since the last step, not counted in the step's time
        self.probe_offered = False  # the trainer called ``probe`` (at any step)
        self.widths: list[int | None] = []  # per step: the widest batch's input width (``width``)
        self.step_width: int | None = None
        self.dtype_seen: str | None = None  # the coarsest dtype the trainer was seen computing in (``saw_dtype``)
        self.frozen_count: int | None = None  # the model's frozen parameters (``saw_model``)
        self.start_dtypes: dict[str, str] | None = None  # each parameter's dtype where training started
        self.setup_casts = 0  # the parameters the trainer's own setup cast after ``start`` (``first_step``)
        self.turns = turns.baton() if ctx.rank == 0 else None  # a benchmark's turns (``harness.rank.turns``)

    @property
    def steps(self) -> int:
        return self.done + len(self.history["losses"])

    def resumed(self, step: int, info: dict[str, Any]) -> None:
        """The trainer continues after optimizer step ``step`` from what it saved (``info``: what
        it restored, from where). Its history starts at step ``step + 1``: the steps before were
        trained by the run that saved, and an external trainer restores no record of them."""
        self.done = int(step)
        self.resume = {**info, "step": int(step)}

    def start(self, params: Any = None) -> None:
        """Training begins (from ``params``, when given: ``starting``)."""
        if params is not None:
            self.starting(params)
        self.ctx.phase("train")
        self.t_start = self.t_last = time.perf_counter()

    def saw_model(self, model: Any) -> None:
        """The trainer computes with ``model``: its dtype (``saw_dtype``) and its frozen parameters
        (a LoRA run's base), which the run table shows beside the trained ones."""
        from harness.rank.precision import coarsest_dtype

        self.saw_dtype(coarsest_dtype(model.parameters()))
        self.frozen_count = param_count(model) - param_count(model.trainable_parameters())

    def saw_dtype(self, dtype: str | None) -> None:
        """The trainer computes in ``dtype`` (``harness.rank.precision.coarsest_dtype``): the
        coarsest seen is the precision its result reports and its limits follow."""
        from harness.dtypes import coarsest

        self.dtype_seen = coarsest(d for d in (self.dtype_seen, dtype) if d)

    def starting(self, params: Any = None, digest: str | None = None, saved: Any = None,
                 dtypes: dict[str, str] | None = None) -> None:
        """Training starts from ``params`` (or parameters of ``digest``, kept by rank 0 in the
        file ``saved``): their digest, where the job takes it (``digest_start``), is the replica
        digest before the first step, compared with every other run's (``start_parity``) and
        between the run's ranks (``replica_consistency``), and rank 0 keeps them where the job asks
        (``keep_start``), to measure how far training moved them. A later call before the first
        step replaces an earlier one (a script that broadcasts its weights after building them
        reports again); one after it is refused. ``dtypes``: each parameter's dtype there, where
        ``params`` are not given (a script's start event), compared with the final ones'
        (``dtype_held``)."""
        if self.history["losses"]:
            raise ReportedFailure(f"{self.name} said where training starts after step {self.steps}: run.split and "
                                  f"run.start come before the first step")
        if digest is None and params is not None:
            digest = start_digest(params, self.ctx.job.digest_start)
        if digest is not None:  # None: not taken (``TrainJob.digest_start``), or a start event without one
            self.digests[self.done] = digest
        from harness.rank.precision import param_dtypes

        self.start_dtypes = param_dtypes(params) if params is not None else dtypes
        if saved is not None and self.effects.keeps_start:
            import os

            os.replace(saved, schema.start_params_path(self.ctx.run_dir))
        elif params is not None:
            self.effects.save_start(params)
        if self.rng_from_start:
            self.rng_before = global_rng_states()

    def first_step(self, params: Any) -> None:
        """The trainer's first step is about to update ``params``: a trainer whose own setup casts
        some weights after ``start`` (unsloth-zoo keeps its norm weights float32) trains from their
        dtypes, which ``dtype_held`` compares the final ones with. Called before the first step."""
        from harness.rank.precision import param_dtypes

        if not self.history["losses"]:
            now, before = param_dtypes(params), self.start_dtypes or {}
            self.setup_casts = sum(1 for k, d in now.items() if before.get(k, d) != d)
            self.start_dtypes = now

    def probe(self, step: int, model: Any, compute: Callable[[], tuple[Any, Any, int]],
              micros: Callable[[], list[tuple[Any, Any, Any]] | None] | None = None) -> None:
        """Before optimizer step ``step`` updates anything: a step-local probe there when the job
        plans one (``compute``: the trainer's own global loss, all-reduced gradient and global
        supervised tokens at ``model``'s current parameters; ``micros``: its micro-batches as
        ``(inputs, targets, mask)`` or ``(inputs, targets, mask, forward)``, where it can give
        them, ``harness.rank.defects``; ``step_probe.Probes.take``)."""
        self.probe_offered = True
        if step != self.steps + 1:
            raise ReportedFailure(f"{self.name} probed step {step} before step {self.steps + 1}: a probe comes "
                                  f"before the update of the step it is taken at")
        if step in self.probes.steps:
            self.probe_s += self.probes.take(step, model, compute, self.ctx.rank, self.ctx.world_size, micros)

    def width(self, inputs: int) -> None:
        """The trainer runs a micro-batch ``inputs`` positions wide (padding included) in the
        current step: the run's padded width, which a device may run at very different speeds."""
        self.step_width = max(self.step_width or 0, int(inputs))

    def step(self, step: int, loss: float | None, tokens_global: int | None, tokens_local: int,
             lr: float | None = None, params: Any = None, step_time_s: float | None = None,
             digest: str | None = None) -> None:
        """Optimizer step ``step`` (1, 2, ...) is done: its global loss and supervised tokens as the
        trainer computed them, this rank's tokens, the learning rate, and (at digest steps) the
        parameters after the update (or their ``digest``, as the rank protocol carries it);
        ``params`` may be a function that gives them (``model.parameters``), called only at a
        digest step, so that other steps do not walk the model. Without ``step_time_s``, the time
        since the previous call.
        A trainer that reports on rank 0 only leaves the loss and global tokens ``None`` on the
        other ranks until ``adopt_rank0``."""
        if step != self.steps + 1:
            raise ReportedFailure(f"{self.name} reported step {step} after step {self.steps}: steps are reported "
                                  f"once each, in order, from {self.done + 1}")
        now = time.perf_counter()
        dt = float(step_time_s) if step_time_s is not None else now - self.t_last - self.probe_s
        self.t_last, self.probe_s = now, 0.0
        self.widths.append(self.step_width)
        self.step_width = None
        dt = max(dt, 1e-9)
        memory = self.ctx.step_memory(step)
        self.rss_peak = max(self.rss_peak, memory["rss_bytes"])
        h = self.history
        loss = None if loss is None else float(loss)
        tokens_global = None if tokens_global is None else int(tokens_global)
        for key, value in (("losses", loss), ("step_times_s", dt), ("tok_s_local", tokens_local / dt),
                           ("tok_s_global", None if tokens_global is None else tokens_global / dt),
                           ("tokens_local_per_step", int(tokens_local)),
                           ("learning_rates", None if lr is None else float(lr)),
                           ("tokens_global_per_step", tokens_global)):
            h[key].append(value)
        event = dict(step=step, rank=self.ctx.rank, loss=loss, tokens_global=tokens_global,
                     tokens_local=int(tokens_local), step_time_s=dt, lr=lr, **memory)
        every = self.s.train.digest_every
        if (params is not None or digest is not None) and every and step % every == 0:
            self.digests[step] = event["digest"] = digest if digest is not None else tree_digest(
                params() if callable(params) else params)
        self.ctx.events.emit("step", **event)
        if loss is not None:
            self.effects.callback("step", {"step": step, "loss": loss, "tokens": tokens_global})
        fault = self.ctx.maybe_fault("step", step)  # process-level faults happen inside
        if fault is not None and fault.action == "raise":
            raise RuntimeError(f"injected fault in phase step at step {step}")
        if self.turns is not None:  # a turn waited for is not the next step's time
            self.probe_s += self.turns.after(step)

    def eval(self, step: int, loss: float, tokens: int) -> None:
        """An evaluation after ``step`` optimizer steps: global loss and supervised tokens."""
        record = {"step": int(step), "loss": float(loss), "tokens": int(tokens)}
        self.evals.append(record)
        self.ctx.events.emit("eval", rank=self.ctx.rank, **record)

    def adopt_rank0(self, why: str) -> None:
        """The trainer reports its metrics on rank 0 only (``why``): every rank takes rank 0's
        per-step losses, global tokens and evaluations (sent in one all-reduce after training),
        and the result names them, so ``ranks_agree`` does not count them as agreement."""
        h = self.history
        sent = send_from_rank0(self.ctx, {"losses": h["losses"], "tokens": h["tokens_global_per_step"],
                                          "evals": self.evals})
        trained = len(h["losses"])
        if len(sent["losses"]) != trained or None in sent["losses"]:
            raise ReportedFailure(f"{self.name} reported {len(sent['losses'])} steps on rank 0, but this rank "
                                  f"trained {trained}")
        h["losses"], h["tokens_global_per_step"], self.evals = sent["losses"], sent["tokens"], sent["evals"]
        h["tok_s_global"] = [n / dt for n, dt in zip(h["tokens_global_per_step"], h["step_times_s"], strict=True)]
        self.from_rank0 = {"fields": ["losses", "evals", "tokens_global"], "why": why}

    def saved(self, count: int = 1) -> None:
        """The trainer wrote ``count`` files of its own (weights, adapters, checkpoints) on this rank."""
        self.saves += count

    def finish(self, params: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Training ended with ``params``: rank 0 keeps them for the judge; returns the rank's result."""
        if self.finished is not None:
            return self.finished
        try:
            return self._finish(params, extra)
        finally:
            if self.turns is not None:  # the other side's last turn, once this one has finished
                self.turns.hand_on()

    def _finish(self, params: Any, extra: dict[str, Any] | None) -> dict[str, Any]:
        if not self.history["losses"]:
            raise ReportedFailure(f"{self.name} {schema.NO_STEPS}")
        runtime = time.perf_counter() - self.t_start
        self.ctx.phase("save")
        self.effects.keep_params_for_judge(params)
        self.effects.close()
        last = self.steps
        every = self.s.train.digest_every
        self.digests = {k: v for k, v in self.digests.items() if k == self.done or (every and k % every == 0)}
        self.digests[last] = tree_digest(params)
        from harness.rank.precision import dtype_changes, rank_precision

        if self.start_dtypes is None:
            from harness.scenario.names import CheckName

            why = "the trainer said no dtypes of the parameters it started from"
            self.not_applicable.setdefault(CheckName.dtype_held, why)

        lrs = self.history["learning_rates"]
        self.finished = schema.train_result(**{
            "trainer": {"kind": self.s.trainer.kind, "title": self.name},
            "model_config": None,
            "not_applicable": self.not_applicable,
            "steps": last,
            "steps_planned": self.s.train.steps,
            "steps_start": self.done + 1,
            "input_widths": self.widths if any(w is not None for w in self.widths) else [],
            "history_start": self.done + 1,
            "resume": self.resume,
            **{k: v for k, v in self.history.items() if k != "learning_rates"},
            "learning_rates": lrs if all(v is not None for v in lrs) else [],
            "tokens_local": sum(self.history["tokens_local_per_step"]),
            "tokens_global": sum(self.history["tokens_global_per_step"]),
            "runtime_s": runtime,
            "train_time_s_total": runtime,
            "digests": {str(k): v for k, v in self.digests.items()},
            "final_digest": self.digests[last],
            "param_count": param_count(params),
            "dtype_changes": dtype_changes(self.start_dtypes, params, self.setup_casts),
            "evals": self.evals,
            "stop": None,
            "compile": {"mode": self.s.train.compile, "scope": self.compile_scope,
                        "fallback_reason": self.fallback_reason},
            "side_effects": {"saves": self.saves},
            "data": {"streaming": True, "rows_read": self.stream.rows_read, "bytes_held": None}
            if self.stream is not None else {"streaming": False, "bytes_held": self.data_bytes},
            "rss_step_peak_bytes": self.rss_peak,
            "seed_used": self.s.seed,
            "precision": rank_precision(self.dtype_seen or self.s.model.built_dtype, self.s.model.dtype),
            **rng_changes(self.rng_before),
            "probes": self.probes.records if self.probes.mode else None,
            "from_rank0": self.from_rank0,
            **({"param_count_frozen": self.frozen_count} if self.frozen_count else {}),
            **(extra or {}),
        })
        return self.finished
