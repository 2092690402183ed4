"""The reference DDP trainer for text and vision-language models: one readable loop,
token-weighted across ranks.

Each optimizer step, every rank:
  1. fetches its rows of each of the step's ``grad_accum`` micro-batches (``batching``);
  2. agrees with its peers (``consensus``): any rank's failure so far, stop requests, and the
     step's global supervised token count T (zero stops every rank with the same message);
  3. at a step-local probe step, computes the global gradient at the reference run's parameters
     (``step_probe``) without touching its own trajectory;
  4. builds, per micro-batch, the gradient of (its token-loss sum) x N / T, compiled or eager
     (``step``), and accumulates them (earlier micro-batches of an accumulating step are
     evaluated as they go, which bounds memory); agrees again that every rank built its step
     (a failure or a compile fallback);
  5. averages gradients with ``nn.average_gradients`` (sum / N), which leaves the sum of every
     rank's token-loss gradients over T: one process's update of the same global batch;
  6. clips and applies the update; all-sums its loss sum for the logged loss, sum / T; steps 4-6
     are evaluated once, as one graph (compiled as one call in the ``full-step`` scope; an eager
     step on a CUDA GPU starts its local forward once every rank built its step, ``start_forward``);
  7. on rank 0 only, runs callbacks and logs; evaluates when due (``evaluate``).
The arithmetic of steps 4-6 (and which rows, seed and learning rate a rank uses) lives in
``semantics``, where a run's ``mutation`` replaces one formula with a real DDP bug.
Every ``checkpoint_every`` steps (and at the run's last step) rank 0 writes a checkpoint
(``checkpoint``, ``resume``); a resumed run verifies it on every rank, agrees that every rank
resolved the same one, and continues from the step after it.
Then rank 0 saves the parameters, and every rank agrees that the save worked.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from harness.rank import step_probe, turns
from harness.rank.consensus import Coordinator, RankFailure
from harness.rank.context import RankContext
from harness.rank.effects import MainRankEffects
from harness.rank.models import build_model, param_digest, start_digest
from harness.rank.optimizer import build_optimizer
from harness.rank.precision import param_dtypes, rank_precision
from harness.rank.reporter import global_rng_states, rng_changes
from harness.trainers.reference import resume
from harness.trainers.reference.batching import LocalBatch, collate, uneven_last
from harness.trainers.reference.evaluate import evaluate
from harness.trainers.reference.progress import Progress
from harness.trainers.reference.rank_data import load_data
from harness.trainers.reference.result import rank_result
from harness.trainers.reference.semantics import Semantics, semantics
from harness.trainers.reference.step import CompileFailed, LocalStep, start_forward


class Trainer:
    def __init__(self, ctx: RankContext):
        import psutil

        self.ctx = ctx
        self.s = ctx.job.scenario
        self.spec, self.N = self.s.train, ctx.world_size
        self.emulate = int(ctx.job.emulate or 1)
        self.semantics: Semantics = semantics(ctx.job.mutation, self.N, self.spec.grad_accum, ctx.rank,
                                              ctx.group, self.emulate)
        self.uneven = uneven_last(self.spec.global_batch, self.spec.grad_accum, ctx.rank, self.N)
        self.probes = step_probe.Probes(ctx.job.probe)
        self.coord = Coordinator(ctx.group, ctx.rank, ctx.world_size)
        self.effects = MainRankEffects(ctx.run_dir, ctx.rank, ctx.job.keep_start)
        self.proc = psutil.Process()
        self.progress = Progress()
        self.rss_peak = self.proc.memory_info().rss
        self.stop: dict[str, Any] | None = None
        self.ckpt_root = Path(ctx.job.checkpoint_dir) if ctx.job.checkpoint_dir else None
        self.end_step = int(ctx.job.stop_after or self.spec.steps)
        self.checkpointing = self.ckpt_root is not None and (
            self.spec.checkpoint_every > 0 or self.end_step < self.spec.steps)
        self.checkpoints: list[dict[str, Any]] = []
        self.last_checkpoint = 0
        self.resumed: dict[str, Any] | None = None
        self.start_dtypes: dict[str, str] | None = None  # each parameter's dtype where training started
        self.step_phases: dict[str, float] = {}  # fetch_s, build_s, eval_s of the step being trained
        self.t_train = time.perf_counter()
        self.input_widths: list[int] = []  # per step this run trained: its widest micro-batch, padding included

    # -- phases ---------------------------------------------------------------------------------

    def fetch(self, step: int) -> list[LocalBatch]:
        self.ctx.maybe_fault("fetch", step)
        pad, seed, drop, vlm = self.data.tok.pad_id, self.s.seed, self.spec.input_dropout, self.s.model.vision
        micros = [collate([e for _, e in rows], pad, drop, [(seed, step, i) for i, _ in rows], vlm, self.data.protected,
                          self.spec.pad_to) for rows in self.data.train.micro_batches(step)]
        return self.semantics.micro_batches(micros, self.uneven)

    def compute(self, micros: list[LocalBatch], scale: Any, fault: str | None, update: bool = True
                ) -> tuple[Any, Any, Any]:
        """Local loss sum, the accumulated gradients of each rank this process computes (one, or
        each emulated rank's), and the gradient norm of a fused step (which leaves no gradients:
        None). For an update, the last micro-batch is left lazy: the step is evaluated once, after
        every rank agreed that it built its part."""
        import mlx.core as mx
        from mlx.utils import tree_map

        loss_total, per_shard = mx.array(0.0, dtype=mx.float32), []
        size = -(-len(micros) // self.emulate) if micros else 1  # micro-batches of each (emulated) rank
        fused = update and self.runner.fuses
        for start in range(0, len(micros), size):
            acc = None
            for m, b in enumerate(micros[start : start + size], start):
                last, f = m == len(micros) - 1, fault if m == 0 else None
                if fused and last:
                    loss_sum, norm = self.runner.full(b.arrays(), scale, f, acc)
                    return loss_total + loss_sum, None, norm
                loss_sum, grads = self.runner.grad(b.arrays(), scale, f, lazy=update and last)
                loss_total = loss_total + loss_sum
                acc = grads if acc is None else tree_map(lambda a, g: a + g, acc, grads)
            per_shard.append(self.semantics.accumulated(acc))
        if not per_shard:  # a rank left with no micro-batch (a mutation that drops rows)
            per_shard = [tree_map(mx.zeros_like, self.model.trainable_parameters())]
        return loss_total, per_shard, None

    def global_gradient(self, step: int, micros: list[LocalBatch], tokens: tuple[int, int], fault: str | None,
                        update: bool = True) -> tuple[Any, Any, Any]:
        """(logged global loss, reduced gradients or None after a fused step, gradient norm or None);
        lazy for an update, evaluated for a probe (``update=False``)."""
        import mlx.core as mx

        scale = mx.array(self.semantics.scale(*tokens), dtype=mx.float32)
        loss_sum, per_shard, norm = self.local_step(step, micros, scale, fault, update)
        if update and per_shard is not None:  # not a fused call: the local forward starts now (CUDA)
            try:  # its evaluation has begun: an error in it is this rank's, as in train_step's eval
                start_forward(loss_sum)
            except Exception as e:
                raise self._eval_failed(step, e) from e
        loss = self.semantics.loss(loss_sum if loss_sum is not None else mx.array(0.0), *tokens)
        if per_shard is None:
            return loss, None, norm
        grads = self.semantics.reduce_shards(per_shard)
        if not update:
            mx.eval(grads, loss)
        return loss, grads, norm

    def local_step(self, step: int, micros: list[LocalBatch], scale: Any, fault: str | None, update: bool = True
                   ) -> tuple[Any, Any, Any]:
        """Build the step; on a compile failure anywhere, strict fails and best-effort re-runs eagerly."""
        if update and self.runner.fuses:  # the update is built inside the fused call
            self.coord.attempt("update", step, self.ctx.maybe_fault, "update", step)
        out = self.coord.attempt("step", step, self._compute_or_compile_error, step, micros, scale, fault, update)
        agreed = self.coord.agree()
        if not agreed.compile_failures:
            self.runner.settled()
        else:
            if self.spec.compile == "strict":
                self.coord.fail_all(agreed.compile_failures)
            first = min(agreed.compile_failures)
            reason = f"rank {first} failed while {agreed.compile_failures[first]}"
            self.runner.discard()  # a rank whose fused call built holds its lazy update
            self.runner.fall_back(reason)
            self.ctx.events.emit("compile_fallback", step=step, rank=self.ctx.rank, reason=reason)
            out = self.coord.attempt("step", step, self.compute, micros, scale, fault, update)
            self.coord.agree()
        return out if out is not None else (None, None, None)

    def _compute_or_compile_error(self, step: int, micros: list[LocalBatch], scale: Any, fault: str | None,
                                  update: bool) -> Any:
        try:
            return self.compute(micros, scale, fault, update)
        except CompileFailed as e:  # reported as the compiler's own error
            self.coord.fail_later("compile", step, e.__cause__ or e)
            return None

    def train_step(self, step: int, micros: list[LocalBatch], tokens: tuple[int, int], fault: str | None
                   ) -> tuple[float, float | None]:
        """Build the step (``global_gradient``), clip and apply the reduced gradients (a local
        failure waits for the next agreement), then evaluate the whole step at once: its
        gradients, all-reduce, update and loss. Returns (logged loss, gradient norm)."""
        import mlx.core as mx

        t0 = time.perf_counter()
        loss, grads, norm = self.global_gradient(step, micros, tokens, fault)
        unapplied = None
        if grads is not None:
            norm = self.coord.attempt("update", step, self._update, step, grads)
            # The update holds the gradients; unreferenced, MLX may reuse their buffers in it. An
            # update that failed here holds nothing: its gradients (and their all-reduce, which the
            # peers wait in) are evaluated on their own.
            unapplied = grads if norm is None else None
            del grads
        t1 = time.perf_counter()
        try:  # every rank built the same collectives; an error here is this rank's alone
            mx.eval(self.model.state, self.optimizer.state, loss, norm, unapplied)
        except Exception as e:
            raise self._eval_failed(step, e) from e
        self.step_phases.update(build_s=t1 - t0, eval_s=time.perf_counter() - t1)
        if self.spec.grad_norms == "off" and self.spec.max_grad_norm == 0:
            return float(loss.item()), None  # not recorded (``TrainSpec.grad_norms``)
        return float(loss.item()), float(norm.item()) if norm is not None else float("nan")

    def _eval_failed(self, step: int, e: Exception) -> RankFailure:
        return RankFailure(f"rank {self.ctx.rank} failed while evaluating step {step}: {type(e).__name__}: {e}")

    def _update(self, step: int, grads: Any) -> Any:
        self.ctx.maybe_fault("update", step)
        return self.runner.apply(grads)

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:

        ctx, spec, coord = self.ctx, self.spec, self.coord
        rng_before = global_rng_states()
        loaded = resume.open_checkpoint(ctx, coord, self.s) if ctx.job.resume is not None else None
        if loaded:
            self.resumed = loaded[3]
            self.s = dataclasses.replace(self.s, seed=loaded[2]["seed"])  # every draw continues as before
        ctx.phase("data")
        rss0 = self.proc.memory_info().rss
        done = loaded[2]["step"] if loaded else 0
        self.data = coord.attempt("data", 0, load_data, self.s, self.semantics.data_rank(), self.N, done,
                                  self.emulate)
        coord.agree()
        data_rss = self.proc.memory_info().rss - rss0

        ctx.phase("model")
        built = coord.attempt("model", 0, build_model, self.s.model, self.data.tok.vocab_size,
                              self.semantics.init_seed(self.s.seed), self.data.vision)
        coord.agree()
        self.model, self.config = built
        self.precision = rank_precision(self.s.model.built_dtype)
        self.optimizer = build_optimizer(spec, self.semantics.learning_rate(spec.learning_rate))
        self.runner = LocalStep(self.model, self.optimizer, spec, self.semantics, alone=self.N == 1)
        if loaded:
            restored = coord.attempt("resume", done, self._restore, *loaded[:3])
            coord.agree()
            self.resumed = {**self.resumed, **restored}
        if (digest := start_digest(self.model.parameters(), ctx.job.digest_start)) is not None:
            self.progress.digests[self.progress.start_step - 1] = digest
        self.start_dtypes = param_dtypes(self.model.parameters())
        coord.attempt("save", self.progress.start_step - 1, self.effects.save_start, self.model)  # agreed at step 1

        ctx.phase("train")
        self.t_train = time.perf_counter()
        last = self.progress.start_step - 1
        for step in range(self.progress.start_step, self.end_step + 1):
            t0 = time.perf_counter()
            micros = coord.attempt("fetch", step, self.fetch, step)
            agreed = coord.agree([sum(b.tokens for b in micros) if micros else 0,
                                  sum(b.images for b in micros) if micros else 0])
            self.step_phases = {"fetch_s": time.perf_counter() - t0}
            if agreed.stop_ranks:
                self._stopped(agreed.stop_ranks, last)
                break
            tokens = agreed.values[0]
            if tokens == 0:
                raise coord.stop_all(f"step {step}: the global batch has zero supervised tokens across all "
                                     f"{self.N} ranks")
            counts = (tokens, sum(b.tokens for b in micros) if micros else 0)
            probe_s = self.probes.run(self, step, micros, counts) if step in self.probes.steps else 0.0
            fault = ctx.maybe_fault("step", step)
            action = fault.action if fault is not None else None
            loss, norm = self.train_step(step, micros, counts, action if action in ("raise", "compile_error") else None)
            last = step
            self._record(step, micros, (tokens, agreed.values[1]), loss, norm, time.perf_counter() - t0 - probe_s)
            if action == "stop":
                coord.stop_requested = True
            if spec.eval_every and step % spec.eval_every == 0:
                self._evaluate(step)
            every = spec.checkpoint_every
            if self.checkpointing and (step == self.end_step or (every and step % every == 0)):
                self._checkpoint(step)
            if ctx.rank == 0:  # a benchmark's turns, where it sets them (outside the step's time)
                turns.after(step)
        if ctx.rank == 0:
            turns.hand_on()
        runtime = self.train_clock()

        agreed = coord.agree()  # a failed last update, or a stop requested after the last step
        if agreed.stop_ranks and self.stop is None:
            self._stopped(agreed.stop_ranks, last)
        if self.checkpointing and last >= self.progress.start_step and self.last_checkpoint != last:
            self._checkpoint(last)  # a stopped run can be resumed too
        if self.data.evals is not None and (not self.progress.evals or self.progress.evals[-1]["step"] != last):
            self._evaluate(last)
        ctx.phase("save")

        def save() -> None:
            ctx.maybe_fault("save", last)
            self.effects.save_params(self.model)

        coord.attempt("save", last, save)
        coord.agree()
        self.effects.close()
        self.progress.digests[last] = param_digest(self.model)
        return rank_result(self, last, runtime, data_rss, rng_changes(rng_before))

    def train_clock(self) -> float:
        return time.perf_counter() - self.t_train

    # -- checkpoints: the trainer's state as dicts (``resume``) ------------------------------------

    def state_dict(self, step: int, by_rank: list[list[float]]) -> dict[str, Any]:
        compile_state = {"mode": self.spec.compile, "scope": self.runner.scope,
                         "fallback_reason": self.runner.fallback_reason}
        return resume.trainer_state(self.progress, step, by_rank, self.s, self.N, self.data.train, compile_state,
                                    self.progress.train_time_before + self.train_clock())

    def load_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        restored = resume.restore(self.progress, state, self.ctx.rank, self.N)
        made = state["compile"]
        if made["fallback_reason"] and made["mode"] == self.spec.compile:
            self.runner.fall_back(f"{made['fallback_reason']} (before the checkpoint of step {state['step']})")
        return restored

    def _restore(self, params: dict[str, Any], opt: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        resume.load_weights(self.model, self.optimizer, params, opt, Path(self.resumed["from"]))
        return self.load_state_dict(state)

    def _checkpoint(self, step: int) -> None:
        from mlx.utils import tree_flatten

        by_rank = self.coord.gather(self.progress.local_history())
        info = resume.write_checkpoint(
            self.ctx, self.coord, self.effects, self.ckpt_root, step, self.spec.keep_last,
            lambda: (dict(tree_flatten(self.model.parameters())), dict(tree_flatten(self.optimizer.state)),
                     self.state_dict(step, by_rank)))
        self.last_checkpoint = step
        if info is not None:
            self.checkpoints.append(info)

    # -- bookkeeping ----------------------------------------------------------------------------

    def _evaluate(self, step: int) -> None:
        ctx = self.ctx

        def before() -> str | None:
            fault = ctx.maybe_fault("eval", step)
            return fault.action if fault is not None else None

        metrics = evaluate(self.model, self.data.evals, self.data.tok.pad_id, self.coord, step, before,
                           self.s.model.vision, self.spec.pad_to)
        if metrics.pop("requested") == "stop":
            self.coord.stop_requested = True
        self.progress.evals.append(metrics)
        ctx.events.emit("eval", rank=ctx.rank, **metrics)
        self.coord.attempt("callback", step, self.effects.callback, "eval", metrics)

    def _stopped(self, ranks: list[int], step: int) -> None:
        self.stop = {"step": step, "requested_by": ranks}
        self.ctx.events.emit("stop", rank=self.ctx.rank, **self.stop)
        self.effects.log("stop", self.stop)

    def _record(self, step: int, micros: list[LocalBatch], counts: tuple[int, int], loss: float, norm: float | None,
                dt: float) -> None:
        ctx = self.ctx
        tokens, images = counts
        local = sum(b.tokens for b in micros)
        memory = ctx.step_memory(step)
        self.rss_peak = max(self.rss_peak, memory["rss_bytes"])
        lr = float(self.optimizer.learning_rate.item())
        self.progress.record({"losses": loss, "step_times_s": dt, "tok_s_local": local / dt,
                              "tok_s_global": tokens / dt, "tokens_local_per_step": local, "grad_norms": norm,
                              "learning_rates": lr,
                              "tokens_global_per_step": tokens, "images_global_per_step": images,
                              "img_s_global": images / dt}, local, tokens, sum(b.images for b in micros))
        self.input_widths.append(max((b.inputs.shape[1] for b in micros), default=0))
        event: dict[str, Any] = dict(
            step=step, rank=ctx.rank, loss=loss, tokens_global=tokens, tokens_local=local,
            rows_local=sum(len(b.inputs) for b in micros), images_global=images, step_time_s=dt, grad_norm=norm, lr=lr,
            cpu_s=time.process_time(), **self.step_phases, **memory,
        )
        if self.spec.digest_every and step % self.spec.digest_every == 0:
            self.progress.digests[step] = event["digest"] = param_digest(self.model)
        ctx.events.emit("step", **event)
        self.coord.attempt("callback", step, self.effects.callback, "step",
                           {"step": step, "loss": loss, "tokens": tokens, "lr": lr})


def run(ctx: RankContext) -> dict[str, Any]:
    return Trainer(ctx).run()
