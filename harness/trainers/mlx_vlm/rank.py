"""mlx-vlm's trainer under test: ``mlx_vlm.trainer.Trainer`` (supervised fine-tuning of a
vision-language model), full fine-tuning or LoRA, with its own distributed path.

The scenario's VLM (seeded weights from its config, or a local model directory) and image rows
(encoded by the model's own image processor, as the reference trainer encodes them) go to
``Trainer(model, VLMTrainingArgs(...), train_dataset=..., eval_dataset=..., optimizer=...,
prepared=True, training_callback=..., seed=...)`` through its public parameters: each row is a
prepared dict of ``input_ids``, ``attention_mask``, ``completion_mask`` (the scenario's supervised
tokens; ``train_on_completions``) and the image inputs. Everything else is mlx-vlm's own: its
batching (rows grouped by media and sorted by length, batches in a seeded order, rank r taking the
r-th contiguous slice of each global batch), its loss (each rank's token mean), its gradient
``average_gradients``, its token-weighted metrics, its evaluation (whole global batches only) and
its rank-0 saves.

What the adapter adds: mlx-vlm's own batch iterator (``iterate_vlm_batches``, given to its own
``make_task``) wrapped to see each batch on every rank: this rank's supervised tokens, the step
boundaries (the next batch is drawn only after the step before it is done) and the parameters
there for replica digests. In a floor run the model computes each batch in the ranks' row chunks
(``harness.rank.split_floor.split_forward``; image patches picked image by image). mlx-vlm calls its training
callback on rank 0 only, so the global loss, tokens and evaluations are rank 0's, sent to the
other ranks after training (``ranks_agree`` says so and does not compare them).

Step-local probes go through mlx-vlm's own step (``mlx_vlm.trainer.common.engine.train``): when
the engine draws the first micro-batch of a probe step, the model holds the parameters that step's
gradient is taken at; the wrapped iterator draws the step's other micro-batches too (the engine
gets them next, in the same order) and the probe runs them through ``apply_gradient_step`` with
``update=False`` (the task's own loss under ``nn.value_and_grad``, ``normalize_loss_output``,
``accumulate_gradients``), then what ``apply_accumulated_gradients`` does before its update:
``average_gradients`` as mlx-vlm imports it and the division by the micro-batch count. The loss
and tokens are its own ``MetricAccumulator``'s (token-weighted, all-summed), as it reports them.
Not covered: its compiled step (``compile``) is not called, the probe computes the same loss and
reduction eagerly (SFT's task has no ``value_and_grad_factory``: the engine differentiates
``task.loss`` with ``nn.value_and_grad``, as the probe does). For the known defects the probe
also hands the harness the step's micro-batches as ``(inputs, targets, mask, forward)``, shifted,
masked and forwarded as ``vlm_sft_loss`` does (``canonical_micros``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.rank.context import RankContext, ReportedFailure
from harness.rank.reporter import StepReporter
from harness.scenario import Scenario
from harness.scenario.checks import CheckName
from harness.trainers.mlx_vlm import TRAINER

TITLE = TRAINER.entry
NOT_APPLICABLE = {
    CheckName.data_share_bytes: "mlx-vlm's Trainer takes the whole dataset on every rank and indexes each rank's rows",
    CheckName.global_rng_untouched: "mlx-vlm's train() seeds MLX's global RNG with the seed it is given "
                                    "(the scenario's)",
}
RANK0_ONLY = "mlx-vlm calls its training callback on rank 0 only"


def to_item(ex: Any) -> dict[str, Any]:
    """A row as mlx-vlm takes it prepared: token ids, attention, the supervised tokens as its
    ``completion_mask`` (position i: token i is a target) and the image inputs."""
    import numpy as np

    item = {"input_ids": ex.ids.astype(np.int32), "attention_mask": np.ones(len(ex.ids), dtype=np.int32),
            "completion_mask": ex.supervised.astype(np.int32)}
    item.update(ex.vision or {})
    return item


def take_vlm_rows(args: tuple[Any, ...], kwargs: dict[str, Any], rows: int, picked: list[int]
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A VLM forward's arguments ``(input_ids, pixel_values, mask, image_grid_thw=...)`` for the
    ``picked`` rows. The harness's image rows carry one image each: image grids are picked by row,
    and image patches concatenated across rows in their grid-sized blocks."""
    import mlx.core as mx
    import numpy as np

    from harness.rank.split_floor import take_rows

    inputs, pixels, *rest = args
    grid = kwargs.get("image_grid_thw")
    (inputs, *rest), kw = take_rows((inputs, *rest), kwargs, rows, picked)
    if grid is not None:
        kw["image_grid_thw"] = grid[mx.array(picked)]
    if pixels is not None and grid is not None and pixels.ndim == 2:
        ends = np.cumsum(np.prod(np.array(grid), axis=1)).tolist()
        blocks = mx.split(pixels, ends[:-1], axis=0)
        pixels = mx.concatenate([blocks[i] for i in picked], axis=0)
    elif pixels is not None:
        (pixels,), _ = take_rows((pixels,), {}, rows, picked)
    return (inputs, pixels, *rest), kw


class Batches:
    """mlx-vlm's ``iterate_vlm_batches`` seen from this rank (see the module docstring): draws of
    training micro-batches mark the optimizer steps, which are reported to ``rep``. Before the
    first micro-batch of a step the job probes is handed over, that step's micro-batches go to
    ``probe(step, micros)``."""

    def __init__(self, rep: StepReporter, model: Any, accum: int,
                 probe: Callable[[int, list[Any]], None] | None = None):
        self.rep, self.model, self.accum, self.probe = rep, model, accum, probe
        self.drawn = 0
        self.tokens: list[int] = []  # this rank's supervised tokens in the pending step's micro-batches
        self.losses: dict[int, tuple[float, int, float]] = {}  # rank 0: step -> (loss, tokens, lr)
        self.eval_s = 0.0  # time spent evaluating since the last step was reported
        self.same_rows: int | None = None  # the ``same_rows`` mutation: the world size every rank is rank 0 of

    def _take(self, batch: Any) -> Any:
        self.drawn += 1
        self.rep.width(batch["input_ids"].shape[1] - 1)  # its loss shifts: inputs are all but the last
        self.tokens.append(int((batch["completion_mask"][:, 1:] * batch["attention_mask"][:, 1:]).sum()))
        return batch

    def __call__(self, dataset: Any, batch_size: int, max_seq_length: int, *, train: bool = False,
                 seed: Any = None, **kw: Any) -> Any:
        from mlx_vlm.trainer.vlm.sft.runtime import iterate_vlm_batches

        started = time.perf_counter()
        if self.same_rows is not None:
            kw = {**kw, "rank": 0, "world_size": self.same_rows}
        it = iterate_vlm_batches(dataset, batch_size, max_seq_length, train=train, seed=seed, **kw)
        for batch in it:
            if not train:
                yield batch
                continue
            if self.drawn % self.accum == 0:
                if self.drawn:
                    self.report()
                step = self.drawn // self.accum + 1
                if self.probe is not None and step in self.rep.probes.steps:
                    micros = [batch, *(next(it) for _ in range(self.accum - 1))]
                    self.probe(step, micros)
                    for b in micros:
                        yield self._take(b)
                    continue
            yield self._take(batch)
        if not train:
            self.eval_s += time.perf_counter() - started

    def report(self) -> None:
        """The optimizer step whose micro-batches were drawn last is done (on this rank)."""
        step = self.rep.steps + 1
        loss, tokens, lr = self.losses.get(step, (None, None, None))
        dt = time.perf_counter() - self.rep.t_last - self.eval_s - self.rep.probe_s
        self.eval_s = 0.0
        self.rep.step(step, loss, tokens, sum(self.tokens), lr=lr, params=self.model.parameters, step_time_s=dt)
        self.tokens = []


def probe_gradient(model: Any, task: Any, micros: list[Any], accum: int) -> tuple[Any, Any, int]:
    """mlx-vlm's step on ``micros`` without its update, through its own parts: each micro-batch
    through ``apply_gradient_step(..., update=False)`` (the task's loss under ``nn.value_and_grad``,
    as its engine builds it, and ``accumulate_gradients``), then ``apply_accumulated_gradients``'s
    reduction (``average_gradients``, divided by the micro-batch count) without its optimizer
    update; the loss and supervised tokens as its ``MetricAccumulator`` reports them (MLX's
    global RNG key is put back by ``Probes.take``)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map
    from mlx_vlm.trainer.common import utils
    from mlx_vlm.trainer.common.metrics import MetricAccumulator

    value_and_grad = nn.value_and_grad(model, task.loss)
    grads, metrics = None, MetricAccumulator()
    for batch in micros:
        extra = task.loss_args(batch) if task.loss_args is not None else ()
        loss, batch_metrics, grads = utils.apply_gradient_step(model, None, value_and_grad, batch, grads, update=False,
                                                               accumulation_steps=accum, loss_args=extra)
        metrics.add(loss, batch_metrics)
    grads = utils.average_gradients(grads)
    if accum > 1:
        grads = tree_map(lambda value: value / accum, grads)
    values = metrics.compute()
    return mx.array(values["loss"], dtype=mx.float32), grads, int(values["num_tokens"])


def canonical_micros(task: Any, micros: list[Any]) -> list[tuple[Any, Any, Any, Any]]:
    """mlx-vlm's micro-batches as ``(inputs, targets, mask, forward)`` (``harness.rank.defects``),
    as the task's ``vlm_sft_loss`` takes them: inputs all but the last token and targets all but
    the first; the mask its supervised targets (attended, completion tokens where it trains on
    completions, not its ``ignore_index`` -100); ``forward`` its own ``forward_vlm_logits`` on the
    shifted inputs, attention and the batch's image fields."""
    import mlx.core as mx
    from mlx_vlm.trainer.vlm.sft.runtime import _completion_mask, forward_vlm_logits

    options = getattr(task.loss, "keywords", {})  # make_task binds them to its loss
    out = []
    for batch in micros:
        ids, attention = batch["input_ids"], batch["attention_mask"]
        targets = ids[:, 1:]
        mask = mx.logical_and(attention[:, 1:].astype(mx.bool_), targets != -100)
        if options.get("train_on_completions", False):
            completion = _completion_mask(batch, options.get("assistant_id", 77091))
            mask = mx.logical_and(mask, completion[:, 1:].astype(mx.bool_))

        def forward(m: Any, batch: Any = batch) -> Any:
            return forward_vlm_logits(m, batch["input_ids"][:, :-1], batch["attention_mask"][:, :-1], batch)

        out.append((ids[:, :-1], targets, mask.astype(mx.float32), forward))
    return out


def make_callback(batches: Batches, accum: int) -> Any:
    """The callback mlx-vlm calls on rank 0 after each report (every optimizer step) and evaluation."""
    from mlx_vlm.trainer import TrainingCallback

    class Report(TrainingCallback):
        def on_train_loss_report(self, info: dict[str, Any]) -> None:
            step = int(info["iteration"]) // accum
            batches.losses[step] = (info["train_loss"], int(info["train_num_tokens"]), info["learning_rate"])

        def on_val_loss_report(self, info: dict[str, Any]) -> None:
            batches.rep.eval(int(info["iteration"]) // accum, info["val_loss"], int(info["val_num_tokens"]))

    return Report()


def add_lora(model: Any, s: Scenario) -> None:
    """mlx-vlm's own LoRA (``get_peft_model``) on every transformer layer it finds, with the
    scenario's rank and scale; its weights come from MLX's global RNG, seeded with the scenario
    seed first (the same weights on every rank)."""
    import mlx.core as mx
    from mlx_vlm.trainer import get_peft_model

    t = s.trainer
    mx.random.seed(s.seed)
    get_peft_model(model, rank=t.lora_rank, alpha=t.lora_scale * t.lora_rank, dropout=0.0, verbose=False)


def load_libraries(scenario: Scenario) -> None:
    """What every run imports: mlx-vlm's trainer and, through it, transformers."""
    import mlx_vlm.trainer  # noqa: F401


def run(ctx: RankContext) -> dict[str, Any]:
    from importlib.metadata import version

    from mlx_vlm.trainer import Trainer, VLMTrainingArgs
    from mlx_vlm.trainer.vlm.sft.runtime import make_task

    from harness.rank.models import build_model
    from harness.rank.optimizer import build_optimizer
    from harness.rank.split_floor import split_floor, split_forward
    from harness.trainers.common import load_image_rows

    s = ctx.job.scenario
    t, lora = s.train, s.trainer.fine_tune == "lora"
    rep = StepReporter(ctx, s, NOT_APPLICABLE, compile_scope="full-step" if t.compile != "off" else "none")
    ctx.phase("data")
    rows, vision = load_image_rows(s)
    train_set = [to_item(ex) for _, ex in rows.train]
    eval_set = [to_item(ex) for _, ex in rows.eval] or None
    rep.data_bytes = sum(ex.nbytes for _, ex in rows.train)
    ctx.phase("model")
    model, config = build_model(s.model, rows.vocab_size, s.seed, vision)
    if lora:
        add_lora(model, s)
    rep.saw_model(model)  # its dtype, frozen weights included, and a LoRA run's base
    if (plan := split_floor(ctx.job, s.seed)) is not None:
        split_forward(model, plan, take_vlm_rows)
    saves = Path(ctx.run_dir) / f"rank{ctx.rank}.mlx_vlm"
    saves.mkdir(exist_ok=True)
    accum = t.grad_accum
    iters = t.steps * accum
    args = VLMTrainingArgs(
        batch_size=t.global_batch // accum, iters=iters, gradient_accumulation_steps=accum, val_batches=-1,
        steps_per_report=accum, steps_per_eval=t.eval_every * accum if t.eval_every else None,
        steps_per_save=t.checkpoint_every * accum if t.checkpoint_every else iters + 1,
        adapter_file=str(saves / "adapters.safetensors"), compile=t.compile != "off",
        max_seq_length=s.data.max_seq_len, pad_token_id=rows.tokenizer.pad_id, train_on_completions=True)
    batches = Batches(rep, model, accum)
    batches.same_rows = ctx.world_size if ctx.job.mutation == "same_rows" else None
    try:
        task = make_task(model, args, iterate_batches=batches)
        batches.probe = lambda step, micros: rep.probe(step, model, lambda: probe_gradient(model, task, micros, accum),
                                                       lambda: canonical_micros(task, micros))
        trainer = Trainer(model, args, task=task, train_dataset=train_set, eval_dataset=eval_set,
                          optimizer=build_optimizer(t), prepared=True,
                          training_callback=make_callback(batches, accum), seed=s.seed)
        rep.start(model.parameters())
        trainer.train()
        batches.report()  # the last step: no batch is drawn after it
    except ReportedFailure:
        raise
    except Exception as e:
        raise ReportedFailure(f"trainer {TRAINER.kind} ({TITLE}) raised {type(e).__name__}: {e}") from e
    rep.adopt_rank0(RANK0_ONLY)
    rep.saved(sum(1 for f in saves.iterdir() if f.suffix == ".safetensors"))
    trained = model.trainable_parameters() if lora else model.parameters()
    return rep.finish(trained, {"model_config": config, "trainer": {
        "kind": TRAINER.kind, "title": TITLE, "version": version(TRAINER.package), "fine_tune": s.trainer.fine_tune}})

