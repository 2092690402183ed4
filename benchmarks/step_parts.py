"""The reference trainer's fused step beside mlx-lm's bare step, piece by piece, in one process.

``step_vs_mlx_lm.py`` times whole runs; this takes their steps apart on one rank (no group): the
same model, rows and optimizer, each variant built afresh, its step timed as build (the lazy
graph: the call of the compiled function) and eval (``mx.eval`` of the model, the optimizer state
and the outputs, then the loss read back), median after 2 untimed steps. Variants:

- ``anchor``: mlx-lm's step as ``harness.rank.anchor`` runs it (``default_loss``,
  ``nn.average_gradients``, the update, compiled over the state), its batch made once;
- ``anchor, new batch``: the same, given a new batch from the host each step, as a trainer is;
- ``anchor, batch made after`` and ``anchor, batch made during``: the new batch made after the
  last step's ``mx.eval`` (outside the timed build; its own time printed), or while the last step
  evaluates (``mx.async_eval``, the batch, then ``mx.eval``);
- ``reference``: the reference trainer's ``LocalStep.full`` as a rank with peers runs it (its loss,
  the token-count scale, the snapshot of the state a peer's failure would restore; a rank without
  peers takes it only where a call traces), a new batch each step;
- ``reference, no snapshot`` and ``reference, tree_map snapshot`` (how it snapshotted before);
- ``reference, bf16 logits``: its loss without the float32 cast of the logits;
- both again with a thread sampling memory every 20 ms, as each rank's ``MemorySampler`` does;
- ``anchor`` and ``reference`` on byte-tokenized rows of the generated text (what the reference
  trains in ``step_vs_mlx_lm.py``) instead of uniform random ids, then ``anchor`` on the random
  ids again: on a CUDA GPU the step's time depends on the tokens.

usage: python benchmarks/step_parts.py [--model tiny|cpu3m|gpu044b] [--steps N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_vs_mlx_lm import MODELS  # noqa: E402


def timed(name: str, steps: int, build: Callable[[], Any], evaluate: Callable[[Any], Any]) -> list[Any]:
    b, e = [], []
    for k in range(steps):
        t0 = time.perf_counter()
        out = build()
        t1 = time.perf_counter()
        evaluate(out)
        if k >= 2:
            b.append(t1 - t0)
            e.append(time.perf_counter() - t1)
    med = [statistics.median(x) * 1e3 for x in (b, e, [x + y for x, y in zip(b, e, strict=True)])]
    print(f"  {name}: build {med[0]:.2f} ms, eval {med[1]:.2f} ms, step {med[2]:.2f} ms", flush=True)
    return [name, *(f"{m:.2f}" for m in med)]


def text_rows(rows: int, length: int) -> Any:
    """``rows`` rows of the generated text corpus, byte-tokenized, ``length`` tokens each (the rows
    ``step_vs_mlx_lm.py``'s scenario trains)."""
    import numpy as np

    from harness.data.sources import generated_text
    from harness.data.tokenizers import ByteTokenizer

    rng, tok = np.random.default_rng([5, 0]), ByteTokenizer()
    return np.array([tok.encode(generated_text(rng, 2 * length, 2 * length))[:length] for _ in range(rows)],
                    dtype=np.int32)


class Parts:
    def __init__(self, model: str, steps: int):
        import numpy as np

        from harness.scenario import ModelSpec, TrainSpec

        self.config, self.dtype, self.seq, self.rows = MODELS[model]
        self.steps = steps
        self.spec = TrainSpec(steps=steps, global_batch=self.rows, learning_rate=1e-4, compile="best_effort",
                              grad_norms="off")
        self.model_spec = ModelSpec(arch="qwen3", dtype=self.dtype, config=self.config)
        self.random = np.random.default_rng(0).integers(0, 259, size=(self.rows, self.seq + 1), dtype=np.int32)
        self.text = text_rows(self.rows, self.seq + 1)
        self.tokens = self.random

    def fresh(self) -> tuple[Any, Any]:
        import mlx.core as mx

        from harness.rank.models import build_model
        from harness.rank.optimizer import build_optimizer

        model, _ = build_model(self.model_spec, 259, 5)
        mx.eval(model.parameters())
        return model, build_optimizer(self.spec)

    def on(self, tokens: str) -> Parts:
        """The variants after this train ``tokens``: ``random`` ids or byte-tokenized ``text``."""
        self.tokens = self.text if tokens == "text" else self.random
        return self

    def anchor(self, name: str, new_batch: bool, made: str = "in build") -> list[Any]:
        import mlx.core as mx
        import mlx.nn as nn
        from mlx_lm.tuner.trainer import default_loss

        model, opt = self.fresh()
        opt.init(model.trainable_parameters())
        vg = nn.value_and_grad(model, default_loss)
        state = [model.state, opt.state]

        def step(batch: Any, lengths: Any) -> Any:
            (loss, ntok), g = vg(model, batch, lengths)
            opt.update(model, nn.average_gradients(g))
            return loss, ntok

        step = mx.compile(step, inputs=state, outputs=state)
        batch, lengths = mx.array(self.tokens), mx.array([[1, self.seq]] * self.rows)
        if made == "in build":
            return timed(name, self.steps, lambda: step(mx.array(self.tokens) if new_batch else batch, lengths),
                         lambda out: (mx.eval(state, *out), out[0].item()))
        ahead, making = [mx.array(self.tokens)], []

        def evaluate(out: Any) -> None:
            if made == "during":
                mx.async_eval(state, *out)
            else:
                mx.eval(state, *out)
            t0 = time.perf_counter()
            ahead[0] = mx.array(self.tokens)
            making.append(time.perf_counter() - t0)
            mx.eval(state, *out)
            out[0].item()

        row = timed(name, self.steps, lambda: step(ahead[0], lengths), evaluate)
        print(f"    (making a batch: median {statistics.median(making) * 1e3:.3f} ms)", flush=True)
        return row

    def reference(self, name: str, snapshot: str = "slots", f32_logits: bool = True) -> list[Any]:
        import mlx.core as mx
        import mlx.nn as nn
        import numpy as np
        from mlx.utils import tree_map

        from harness.trainers.reference import step as ref
        from harness.trainers.reference.semantics import Semantics

        model, opt = self.fresh()
        slots, loss_fn = ref.state_slots, ref.loss_fn
        if snapshot == "none":
            ref.state_slots = lambda *a, **k: []
        elif snapshot == "tree_map":
            ref.state_slots = lambda s, out=None: [tree_map(lambda a: a, x) for x in s]
        if not f32_logits:
            def bf16_loss(model: Any, batch: dict[str, Any], scale: Any, fault: str | None) -> tuple[Any, Any]:
                ce = nn.losses.cross_entropy(model(batch["inputs"]), batch["targets"], reduction="none")
                s = (ce * batch["mask"]).astype(mx.float32).sum()
                return s * scale, s
            ref.loss_fn = bf16_loss
        try:
            runner = ref.LocalStep(model, opt, self.spec, Semantics(1, 1, 0))
            inputs, targets = self.tokens[:, :-1], self.tokens[:, 1:]
            mask = np.ones_like(targets, dtype=np.float32)

            def build() -> Any:
                arrays = {"inputs": mx.array(inputs), "targets": mx.array(targets), "mask": mx.array(mask)}
                loss_sum, norm = runner.full(arrays, mx.array(1.0 / targets.size, dtype=mx.float32), None)
                runner.settled()
                return loss_sum / targets.size, norm

            return timed(name, self.steps, build, lambda out: (mx.eval(model.state, opt.state, *out), out[0].item()))
        finally:
            ref.state_slots, ref.loss_fn = slots, loss_fn


class Sampling:
    """A thread reading MLX's and the process's memory every 20 ms while it lives."""

    def __enter__(self) -> Sampling:
        import psutil

        self.proc, self.stop = psutil.Process(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        import mlx.core as mx

        while not self.stop.wait(0.02):
            mx.get_active_memory(), mx.get_peak_memory(), self.proc.memory_info()

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--steps", type=int, default=15)
    a = ap.parse_args()
    import mlx.core as mx
    from tabulate import tabulate

    p = Parts(a.model, max(a.steps, 3))
    rows = [p.anchor("anchor", False), p.anchor("anchor, new batch", True),
            p.anchor("anchor, batch made after", True, "after"), p.anchor("anchor, batch made during", True, "during"),
            p.reference("reference"),
            p.reference("reference, no snapshot", snapshot="none"),
            p.reference("reference, tree_map snapshot", snapshot="tree_map"),
            p.reference("reference, bf16 logits", f32_logits=False)]
    with Sampling():
        rows += [p.anchor("anchor, new batch, sampled", True), p.reference("reference, sampled")]
    p.on("text")
    rows += [p.anchor("anchor, text rows", False), p.reference("reference, text rows")]
    p.on("random")
    rows += [p.anchor("anchor, random ids again", False)]
    print(f"{a.model}: {p.rows} x {p.seq} inputs, {p.dtype}, one process on {mx.default_device()}, median of steps "
          f"3-{p.steps}")
    print(tabulate(rows, headers=["step", "build ms", "eval ms", "step ms"]))


if __name__ == "__main__":
    main()
