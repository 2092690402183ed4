"""A process set up as a rank of the harness sets one up (the collective ledger, the memory
sampler, the step bookkeeping outside the timed step), and the variants of
``reference_overlap.py`` timed in it step by step (``Bench``)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from overlap_variants import buckets_reduced, variant_classes

VOCAB = 259  # the generated corpus's byte tokenizer

class NullEvents:
    listeners: list[Any] = []

    def emit(self, kind: str, **fields: Any) -> None:
        pass


class Ctx:
    """What ``Trainer.train_step`` reads of a ``RankContext``."""

    def __init__(self, rank: int, world_size: int, group: Any):
        self.rank, self.world_size, self.group = rank, world_size, group
        self.events = NullEvents()

    def maybe_fault(self, phase: str, step: int) -> None:
        return None


class Process:
    """The ledger and the memory sampler of a harness rank, and the step bookkeeping outside the
    timed step (events, memory, callbacks on rank 0)."""

    def __init__(self, group: Any, bare: bool):
        from harness import schema
        from harness.memory.sampler import MemorySampler, device_baseline_kind, peak_rss_bytes

        self.group, self.rank, self.n = group, group.rank(), group.size()
        self.dir = Path(tempfile.mkdtemp(prefix=f"refov{self.rank}-"))
        self.events = schema.EventWriter(self.dir / "events.jsonl")
        self.ledger: Any = None
        self.sampler: Any = None
        self.bare = bare
        if not bare:
            self.ledger_on()
            self.sampler = MemorySampler(self.events, self.rank, peak_rss_bytes(), device_baseline_kind())
            self.sampler.start()

    def ledger_on(self) -> None:
        from harness.rank.ledger import Ledger

        if self.ledger is None and not self.bare:
            self.ledger = Ledger(self.dir / f"ledger{time.monotonic_ns()}.jsonl", self.n, self.rank)
            self.ledger.install()

    def ledger_off(self) -> None:
        if self.ledger is not None:
            self.ledger.uninstall()
            self.ledger = None

    def sampler_off(self) -> Any:
        s, self.sampler = self.sampler, None
        if s is not None:
            s.stop()
        return s

    def sampler_on(self, s: Any) -> None:
        if s is not None:
            from harness.memory.sampler import MemorySampler

            self.sampler = MemorySampler(self.events, self.rank, s.baseline_bytes or 0, s.baseline)
            self.sampler.start()

    def record(self, step: int, loss: float, lr: float, dt: float) -> None:
        memory = self.sampler.step_ended(step) if self.sampler is not None else {}
        self.events.emit("step", step=step, rank=self.rank, loss=loss, lr=lr, step_time_s=dt, **memory)
        if self.rank == 0:
            with open(self.dir / "callbacks.jsonl", "a") as f:
                f.write(json.dumps({"kind": "step", "step": step, "loss": loss, "lr": lr}) + "\n")
            with open(self.dir / "train.log", "a") as f:
                f.write(f"step step={step} loss={loss:.6g} lr={lr:.6g}\n")

    def barrier(self) -> None:
        import mlx.core as mx

        if self.n > 1:
            mx.eval(mx.distributed.all_sum(mx.ones((1,)), group=self.group))


class Bench:
    def __init__(self, model_name: str, steps: int, bare: bool):
        import mlx.core as mx
        import numpy as np
        from step_vs_mlx_lm import MODELS

        from harness.rank.models import build_model
        from harness.scenario import ModelSpec, TrainSpec
        from harness.trainers.reference.batching import LocalBatch

        self.group = mx.distributed.init()
        self.n, self.rank = self.group.size(), self.group.rank()
        config, dtype, self.seq, self.rows = MODELS[model_name]
        self.steps = steps
        self.spec = TrainSpec(steps=steps, global_batch=self.rows * self.n, learning_rate=1e-4, compile="off",
                              grad_norms="off")
        self.model, _ = build_model(ModelSpec(arch="qwen3", dtype=dtype, config=config), VOCAB, 5)
        self.start_params = self.model.parameters()
        ids = np.random.default_rng([5, self.rank]).integers(3, VOCAB, size=(self.rows, self.seq + 1), dtype=np.int32)
        self.batch = LocalBatch(inputs=ids[:, :-1].copy(), targets=ids[:, 1:].copy(),
                                mask=np.ones((self.rows, self.seq), dtype=np.float32))
        self.ids = ids
        self.proc = Process(self.group, bare)
        self.classes = variant_classes()

    def restore(self) -> None:
        self.model.update(self.start_params)

    # -- the reference ----------------------------------------------------------------------------

    def trainer(self, variant: str) -> Any:
        from harness.rank.consensus import Coordinator
        from harness.rank.optimizer import build_optimizer
        from harness.trainers.reference.semantics import Semantics
        from harness.trainers.reference.step import LocalStep

        cls, sem_cls = self.classes[variant]
        t = cls.__new__(cls)
        t.ctx = Ctx(self.rank, self.n, self.group)
        t.spec, t.N, t.emulate = self.spec, self.n, 1
        t.semantics = (sem_cls or Semantics)(self.n, 1, self.rank, self.group)
        t.coord = Coordinator(self.group, self.rank, self.n)
        t.model = self.model
        t.optimizer = build_optimizer(self.spec)
        t.runner = LocalStep(self.model, t.optimizer, self.spec, t.semantics)
        t.step_phases = {}
        return t

    def reference_steps(self, variant: str, steps: int) -> tuple[list[dict[str, float]], list[float], Any]:
        from dataclasses import replace

        t = self.trainer(variant)
        parts: dict[str, float] = {}
        for obj, attr, key in ((t.runner, "grad", "p_grad"), (t.coord, "agree", "p_agree"),
                               (t.semantics, "loss", "p_loss"), (t.semantics, "reduce_shards", "p_reduce"),
                               (t.runner, "apply", "p_update"), (t, "start", "p_start"), (t, "schedule", "p_sched")):
            if hasattr(obj, attr):
                setattr(obj, attr, timed_call(getattr(obj, attr), parts, key))
        batch = replace(self.batch)
        if variant == "ref-arrays":  # the batch's arrays made once (a diagnostic: a trainer makes them each step)
            made = batch.arrays()
            batch.arrays = lambda: made  # type: ignore[method-assign]
        else:
            batch.arrays = timed_call(batch.arrays, parts, "p_arrays")  # type: ignore[method-assign]
        micros = [batch]
        local = sum(b.tokens for b in micros)
        rows, losses = [], []
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            if variant == "ref-noagree":  # neither agreement (a diagnostic): T known, nothing checked
                total = local * self.n
            else:
                total = t.coord.agree([local, 0]).values[0]  # Trainer.run: the fetch's agreement on T
            fetch = time.perf_counter() - t0
            parts.clear()
            loss, _ = t.train_step(step, micros, (total, local), None)
            dt = time.perf_counter() - t0
            lr = float(t.optimizer.learning_rate.item())
            self.proc.record(step, loss, lr, dt)
            rows.append({"fetch": fetch, "build": t.step_phases["build_s"], "eval": t.step_phases["eval_s"],
                         "step": dt, **parts})
            losses.append(loss)
        return rows, losses, t.optimizer

    # -- mlx-lm's bare step -----------------------------------------------------------------------

    def loop_steps(self, variant: str, steps: int) -> list[dict[str, float]]:
        import mlx.core as mx
        import mlx.nn as nn
        from mlx.utils import tree_flatten
        from mlx_lm.tuner.trainer import default_loss

        from harness.rank.consensus import Coordinator
        from harness.rank.optimizer import build_optimizer

        model, n = self.model, self.n
        optimizer = build_optimizer(self.spec)
        batch, lengths = mx.array(self.ids), mx.array([[1, self.seq]] * self.rows)
        vg = nn.value_and_grad(model, default_loss)
        state = [model.state, optimizer.state]
        rows = []
        coord = Coordinator(self.group, self.rank, n)
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            if variant == "loop-agree":  # the reference's two agreements, in the loop
                coord.agree([self.rows * self.seq, 0])
            (loss, ntok), grads = vg(model, batch, lengths)
            if variant == "loop-agree":
                coord.agree()
            ta = time.perf_counter()
            if n > 1 and variant == "rev":
                grads, reduced = buckets_reduced(grads, n, True, 64)
                if mx.default_device() == mx.gpu:
                    mx.async_eval(reduced)
            else:
                grads = nn.average_gradients(grads)
                if n > 1 and variant == "loop-sched" and mx.default_device() == mx.gpu:
                    mx.async_eval([g for _, g in tree_flatten(grads)][::-1])
            tb = time.perf_counter()
            optimizer.update(model, grads)
            t1 = time.perf_counter()
            mx.eval(state, loss, ntok)
            value = float(loss.item())
            dt = time.perf_counter() - t0
            self.proc.record(step, value, 0.0, dt)
            rows.append({"fetch": 0.0, "build": t1 - t0, "eval": t0 + dt - t1, "step": dt, "p_grad": ta - t0,
                         "p_reduce": tb - ta, "p_update": t1 - tb})
        return rows

    def turn(self, variant: str, steps: int) -> list[dict[str, float]]:
        self.proc.barrier()
        sampler = None
        if variant == "ref-ledger":
            self.proc.ledger_off()
        if variant == "ref-sampler":
            sampler = self.proc.sampler_off()
        try:
            if variant in LOOPS:
                return self.loop_steps(variant, steps)
            return self.reference_steps(variant, steps)[0]
        finally:
            self.proc.ledger_on()
            self.proc.sampler_on(sampler)


LOOPS = ("loop", "rev", "loop-sched", "loop-agree")


def timed_call(fn: Any, parts: dict[str, float], key: str) -> Any:
    """``fn``, adding the seconds each call takes to ``parts[key]``."""
    def call(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            parts[key] = parts.get(key, 0.0) + time.perf_counter() - t0
    return call


