"""The reference trainer's eager step beside mlx-lm's bare step, at one and two ranks, and what in
the reference costs the gradient all-reduce's overlap.

    python benchmarks/reference_overlap.py [--variants A,B,...] [--steps N] [--turns T]     # one rank
    mlx.launch --backend nccl -n 2 -- python benchmarks/reference_overlap.py [...]           # two ranks
    ... reference_overlap.py --check [--variants ...]    # same values as the reference? (any device)
    python benchmarks/reference_overlap.py --harness R    # whole harness runs, as is and proposed

Every variant trains the model of ``step_vs_mlx_lm.py --model`` (default gpu044b: qwen3 0.44B,
bfloat16, 8 rows x 1024 inputs per rank, every token a target) from the same parameters, each for
``--steps`` steps in turn in the same processes, ``--turns`` times round; rank 0 prints per turn
the median ms of steps 4..N of the step, its host build (from the step's start until ``mx.eval``
of the step is called) and its evaluation (``mx.eval`` and reading the loss back), and the host
time of the build's parts (``grad``: the micro-batch's lazy gradient, ``agree``, ``loss``,
``reduce``, ``update``, ``arrays``: the batch to MLX, ``start``/``sched``: the proposal's
``mx.async_eval`` calls, which block the host while MLX's CUDA backend encodes). The process
is set up as a rank of the harness is: the collective ledger installed and the memory sampler
running (``--bare-process``: neither). Variants:

- ``loop``: mlx-lm's bare eager step (``harness.rank.anchor``: ``default_loss``,
  ``nn.average_gradients``, the update, one ``mx.eval``), its batch made once;
- ``rev``: the same, its gradients all-reduced in 64 MiB buckets taken from the last layer back
  and handed to ``mx.async_eval`` before the update (``allreduce_overlap.py``'s ``rev_order``);
- ``loop-sched``: ``nn.average_gradients``'s own buckets, the reduced gradients handed to
  ``mx.async_eval`` last parameter first;
- ``ref``: the reference trainer's step as it is (``Trainer.train_step`` from the harness, after
  the fetch's agreement on the token count, as ``Trainer.run`` calls it; its step bookkeeping
  (``_record``'s events, memory and callbacks) outside the timed step, as there);
- ``ref-agree``: without the agreement inside the step (``local_step``'s ``coord.agree``);
- ``ref-loss``: the logged loss without its all-sum (local sum / T: wrong, a diagnostic);
- ``ref-ledger``: no collective ledger during the turn; ``ref-sampler``: no memory sampler;
- ``ref-arrays``: the batch's arrays made once; ``ref-noagree``: neither agreement (fetch, step);
- ``loop-agree``: ``loop`` with the reference's two agreements (before and after the gradient);
- ``sched64``: the scheme tried before in ``Semantics.reduce``: 64 MiB buckets last layer first,
  handed to ``mx.async_eval`` (different buckets from ``nn.average_gradients``);
- ``sched``: the reference with the reduced gradients (``nn.average_gradients``'s buckets, the
  reduce unchanged) handed to ``mx.async_eval`` last parameter first, where the world has more
  than one rank and MLX computes on a GPU (``Proposed.schedule``);
- ``fwd``: the reference with the local forward (the token-loss sum) handed to ``mx.async_eval``
  once every rank agreed that it built its step, on a GPU (``Proposed.start``): what the
  reference now does itself (``start_forward`` in ``harness/trainers/reference/step.py``);
- ``new``: ``sched`` and ``fwd`` together;
- ``nofwd``: the reference's step as it was before ``start_forward``.

What was seen on two H100s (MLX 0.32.4, ``MLX_DISABLE_COMPILE=1``, TF32 at MLX's default): the
reference's own pieces (both agreements, the loss's all-sum, the batch's arrays, the ledger, the
memory sampler) cost at most a few ms each, within the turns' spread; ``sched``, ``sched64`` and
``new`` were not faster than ``ref`` at two ranks; ``fwd`` shortened the harness's eager step by
17 ms at one rank and 13 ms at two (medians of 3 runs each), so its scaling fell. An
``mx.async_eval`` of a whole backward holds the host 80-130 ms while MLX's CUDA backend encodes
it, and that backend records the NCCL all-reduce into the compute stream's graph (upstream
``AllReduce::eval_gpu``), so reordering the buckets most likely gives back host time rather than
running the all-reduce beside the backward. ``--pin`` (each rank on its own half of the cores)
was no faster.

The figures above (and in docs/gpu.md) were taken before ``start_forward`` landed, ``ref`` then
being today's ``nofwd``: since then ``ref`` (and ``--harness``'s runs "as they are") start their
forward as ``fwd`` does, and ``--proposed nofwd`` (the default) runs the step before it beside.

``--check`` trains ``ref`` and every other reference variant 3 steps each from the same
parameters and a fresh optimizer, and compares the parameters, the optimizer state and the logged
losses with ``ref``'s, bit for bit.

``--harness R``: the eager reference runs of ``step_vs_mlx_lm.py`` (``ws1_eager``, ``ws2_eager``,
launched by the harness under ``MLX_DISABLE_COMPILE=1``), as they are and with a proposal
(``--proposed``: some of ``new``, ``sched``, ``fwd``, ``nofwd``) installed in every rank (through a
``sitecustomize`` on the ranks' ``PYTHONPATH``; ``installed`` counts the processes it patched),
alternating, ``R`` times; prints each run's post-step-1 median tok/s and phases, and each
repeat's scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

PATCH_VAR = "REFERENCE_OVERLAP_PROPOSED"
VOCAB = 259  # the generated corpus's byte tokenizer


# -- the changes tried in the reference's step ----------------------------------------------------

def proposed_class() -> type:
    """``Trainer`` with both changes tried in ``global_gradient``: ``start`` (``fwd``: the
    reference's ``start_forward``, which it now calls itself) and ``schedule`` (``sched``)."""
    from harness.trainers.reference.step import start_forward
    from harness.trainers.reference.trainer import Trainer

    base_step = Trainer.global_gradient  # the reference's own (captured before ``install`` replaces it)

    class Proposed(Trainer):
        def global_gradient(self, step: int, micros: list[Any], tokens: tuple[int, int], fault: str | None,
                            update: bool = True) -> tuple[Any, Any, Any]:
            from harness.trainers.reference import trainer as module

            saved, module.start_forward = module.start_forward, self.start  # the step's own forward start
            try:
                loss, grads, norm = base_step(self, step, micros, tokens, fault, update)
            finally:
                module.start_forward = saved
            if update and grads is not None and self.ctx.world_size > 1:
                self.schedule(grads)
            return loss, grads, norm

        start = staticmethod(start_forward)  # the reference's (``fwd``); ``SchedOnly`` has none

        @staticmethod
        def schedule(grads: Any) -> None:
            """On a GPU, hand the reduced gradients to MLX last parameter first: each bucket's
            all-sum is issued as soon as the backward has its gradients, and runs while the backward
            goes on to the layers before it. The arrays are the reduce's own: the values are not
            touched, only the order the GPU computes them in."""
            import mlx.core as mx
            from mlx.utils import tree_flatten

            if mx.default_device() == mx.gpu:
                mx.async_eval([g for _, g in tree_flatten(grads)][::-1])

    return Proposed


def proposals() -> dict[str, type]:
    """``fwd`` (the change proposed), ``sched``, and both together (``new``)."""
    Proposed = proposed_class()

    class SchedOnly(Proposed):
        start = staticmethod(lambda loss_sum: None)

    class FwdOnly(Proposed):
        schedule = staticmethod(lambda grads: None)

    class NoForward(FwdOnly):  # the reference's step before it started its forward
        start = staticmethod(lambda loss_sum: None)

    return {"new": Proposed, "sched": SchedOnly, "fwd": FwdOnly, "nofwd": NoForward}


def install(name: str = "new") -> None:
    """Make the harness's reference trainer proposal ``name`` (for ``--harness``: in each rank)."""
    import inspect

    from harness.trainers.reference import trainer

    cls = proposals()[name]
    for attr in ("global_gradient", "start", "schedule"):
        setattr(trainer.Trainer, attr, inspect.getattr_static(cls, attr))


# -- diagnostic variants ------------------------------------------------------------------------

def variant_classes() -> dict[str, tuple[type, type | None]]:
    """variant -> (trainer class, semantics class or None for the correct one)."""
    import mlx.core as mx

    from harness.trainers.reference.semantics import Semantics
    from harness.trainers.reference.trainer import Trainer

    proposed = proposals()

    class NoStepAgree(Trainer):
        def local_step(self, step: int, micros: list[Any], scale: Any, fault: str | None, update: bool = True
                       ) -> tuple[Any, Any, Any]:
            out = self.coord.attempt("step", step, self._compute_or_compile_error, step, micros, scale, fault, update)
            self.runner.settled()
            return out if out is not None else (None, None, None)

    class LocalLoss(Semantics):
        def loss(self, loss_sum: Any, tokens: int, tokens_local: int) -> Any:
            return loss_sum / tokens

    class Rev64(Semantics):
        def reduce(self, grads: Any) -> Any:
            if self.world_size == 1:
                return grads
            out, reduced = buckets_reduced(grads, self.world_size, True, 64, self.group)
            if mx.default_device() == mx.gpu:
                mx.async_eval(reduced)
            return out

    return {"ref": (Trainer, None), "ref-agree": (NoStepAgree, None), "ref-loss": (Trainer, LocalLoss),
            "ref-ledger": (Trainer, None), "ref-sampler": (Trainer, None), "ref-arrays": (Trainer, None),
            "ref-noagree": (NoStepAgree, None), "sched64": (Trainer, Rev64),
            "sched": (proposed["sched"], None), "fwd": (proposed["fwd"], None), "new": (proposed["new"], None),
            "nofwd": (proposed["nofwd"], None)}


def buckets_reduced(grads: Any, n: int, reverse: bool, mib: int, group: Any = None) -> tuple[Any, list[Any]]:
    """The gradients averaged over ``n`` ranks in buckets of ``mib`` MiB (``allreduce_overlap.py``'s)."""
    from allreduce_overlap import buckets_reduced as reduced_in_buckets

    return reduced_in_buckets(grads, n, reverse, None, mib, group)


# -- the process, as a rank of the harness sets it up ---------------------------------------------

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


def summary(rows: list[dict[str, float]], skip: int = 3) -> dict[str, float]:
    kept = rows[skip:] if len(rows) > skip else rows
    keys = ["fetch", "build", "eval", "step", *sorted({k for r in kept for k in r if k.startswith("p_")})]
    out = {k: round(statistics.median(r.get(k, 0.0) for r in kept) * 1e3, 2) for k in keys}
    steps = sorted(r["step"] for r in kept)
    out["p25"] = round(steps[len(steps) // 4] * 1e3, 2)
    out["p75"] = round(steps[(3 * len(steps)) // 4] * 1e3, 2)
    return out


def device_name() -> str:
    import mlx.core as mx

    try:
        return str(mx.device_info().get("device_name", mx.default_device()))
    except Exception:  # noqa: BLE001 - a name only
        return str(mx.default_device())


def bench(args: argparse.Namespace) -> None:
    import mlx.core as mx

    b = Bench(args.model, args.steps, args.bare_process)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(b.classes) - set(LOOPS)
    if unknown:
        raise SystemExit(f"unknown variants: {sorted(unknown)}")
    if b.rank == 0:
        print(json.dumps({"world_size": b.n, "device": str(mx.default_device()),
                          "device_name": device_name(),
                          "mlx": mx.__version__, "disable_compile": os.environ.get("MLX_DISABLE_COMPILE"),
                          "tf32": os.environ.get("MLX_ENABLE_TF32", "default"), "ledger_and_sampler": not b.proc.bare,
                          "steps": args.steps, "turns": args.turns}), flush=True)
    got: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for turn in range(args.turns):
        order = variants if turn % 2 == 0 else variants[::-1]  # each variant's turns sit early and late
        for v in order:
            s = summary(b.turn(v, args.steps))
            got[v].append(s)
            if b.rank == 0:
                print(json.dumps({"world_size": b.n, "turn": turn + 1, "variant": v, **s}), flush=True)
    if b.rank == 0:
        print(f"summary, world size {b.n}: median ms of steps 4-{args.steps} per turn")
        for v in variants:
            steps = [s["step"] for s in got[v]]
            builds = [s["build"] for s in got[v]]
            evals = [s["eval"] for s in got[v]]
            print(f"  {v:12s} step {statistics.median(steps):7.2f} (turns {min(steps):.2f}-{max(steps):.2f})  "
                  f"build {statistics.median(builds):6.2f}  eval {statistics.median(evals):7.2f}  "
                  f"fetch {statistics.median(s['fetch'] for s in got[v]):5.2f}  " + "  ".join(
                      f"{k[2:]} {statistics.median(s.get(k, 0.0) for s in got[v]):.2f}"
                      for k in sorted({k for s in got[v] for k in s if k.startswith("p_")})), flush=True)


def check(args: argparse.Namespace) -> None:
    """Every reference variant's parameters, optimizer state and losses after 3 steps against ``ref``'s."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    b = Bench(args.model, 3, True)
    variants = [v for v in args.variants.split(",") if v and v in b.classes and v != "ref"]

    def run(v: str) -> tuple[dict[str, Any], dict[str, Any], list[float]]:
        b.restore()
        _, losses, opt = b.reference_steps(v, 3)
        params = dict(tree_flatten(b.model.parameters()))
        state = dict(tree_flatten(opt.state))
        mx.eval(params, state)
        return params, state, losses

    p0, s0, l0 = run("ref")
    for v in variants:
        p, s, losses = run(v)
        same_p = p.keys() == p0.keys() and all(mx.array_equal(p[k], p0[k]).item() for k in p0)
        same_s = s.keys() == s0.keys() and all(mx.array_equal(s[k], s0[k]).item() for k in s0)
        diff = max(float(mx.abs(p[k].astype(mx.float32) - p0[k].astype(mx.float32)).max().item()) for k in p0)
        if b.rank == 0:
            print(json.dumps({"world_size": b.n, "device": str(mx.default_device()), "variant": v,
                              "params_equal": same_p, "optimizer_state_equal": same_s, "max_abs_param_diff": diff,
                              "losses_equal": losses == l0, "losses": losses, "ref_losses": l0}), flush=True)
    b.restore()


# -- whole runs through the harness ---------------------------------------------------------------

SITE = """import os
if os.environ.get({var!r}, "as_is") != "as_is":
    import sys
    sys.path.insert(0, {here!r})
    import reference_overlap
    reference_overlap.install(os.environ[{var!r}])
    open(os.path.join({marks!r}, str(os.getpid())), "w").close()
"""


def harness_runs(args: argparse.Namespace) -> None:
    import step_vs_mlx_lm as svm

    from harness.scenario import load_scenario
    from harness.scenario.plan import job_for

    site = Path(tempfile.mkdtemp(prefix="refov-site-"))
    marks = site / "installed"
    marks.mkdir()
    (site / "sitecustomize.py").write_text(SITE.format(var=PATCH_VAR, here=str(HERE), marks=str(marks)))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "step_vs_mlx_lm.toml"
        path.write_text(svm.scenario_text(args.model, [1, 2], args.steps))
        s = load_scenario(path)
    specs = {n: s.run(f"ws{n}_eager") for n in (1, 2)}
    tok: dict[tuple[str, int], list[float]] = {}
    whos = ["as_is", *(w for w in args.proposed.split(",") if w)]
    unknown = set(whos[1:]) - set(proposals())
    if unknown:
        raise SystemExit(f"unknown proposals: {sorted(unknown)}")
    for r in range(args.harness):
        order = [(w, n) for w in (whos if r % 2 == 0 else whos[::-1]) for n in (1, 2)]
        for who, n in order:
            os.environ[PATCH_VAR] = who
            before = len(list(marks.iterdir()))
            spec = specs[n]
            with svm.compile_disabled(True):
                value, result = svm.measure(spec, job_for(s, spec.name), args.backend)
            tok.setdefault((who, n), []).append(value)
            ph = {k: round(v * 1e3, 2) for k, v in result.get("phase_medians_s", {}).items()}
            print(json.dumps({"repeat": r + 1, "who": who, "world_size": n, "tok_s": round(value),
                              "step_ms_post_step1_median": round(result["tokens_global_per_step"][0] / value * 1e3, 2),
                              "phases_ms": ph, "device": result.get("device"),
                              "installed": len(list(marks.iterdir())) - before}), flush=True)
    os.environ[PATCH_VAR] = "as_is"
    for who in whos:
        one, two = tok[(who, 1)], tok[(who, 2)]
        pairs = [b / a for a, b in zip(one, two, strict=True)]
        print(f"{who}: tok/s 1 GPU {[round(x) for x in one]}, 2 GPUs {[round(x) for x in two]}; "
              f"scaling best/best {max(two) / max(one):.3f}x, per repeat {[round(p, 3) for p in pairs]} "
              f"(median {statistics.median(pairs):.3f}x)", flush=True)


def pin_rank() -> list[int]:
    """Pin this process to its own share of the physical cores (every hyperthread of each), so that
    no two ranks of one host share a core: rank r of n takes the r-th n-th of the cores."""
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        key = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        cores.setdefault(key, []).append(cpu)
    rank, n = int(os.environ.get("MLX_RANK", "0")), int(os.environ.get("MLX_WORLD_SIZE", "1"))
    ordered = [cores[k] for k in sorted(cores, key=lambda k: min(cores[k]))]
    per = max(1, len(ordered) // n)
    mine = sorted(c for core in ordered[rank * per:(rank + 1) * per] for c in core)
    os.sched_setaffinity(0, mine)
    return mine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpu044b")
    ap.add_argument("--variants", default="ref,loop,rev,loop-sched,sched,fwd,new")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--bare-process", action="store_true", help="no ledger and no memory sampler")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--device", choices=("gpu", "cpu"), default=None)
    ap.add_argument("--harness", type=int, default=0, metavar="R")
    ap.add_argument("--proposed", default="nofwd", help="with --harness: the proposals run beside the reference as is")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--pin", action="store_true", help="pin each rank to its own physical cores (pin_rank)")
    args = ap.parse_args()
    if args.pin:
        print(json.dumps({"rank": os.environ.get("MLX_RANK", "0"), "pinned_to": pin_rank()}), flush=True)
    if args.device:
        import mlx.core as mx

        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    if args.harness:
        harness_runs(args)
    elif args.check:
        check(args)
    else:
        bench(args)


if __name__ == "__main__":
    main()
