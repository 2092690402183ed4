"""unsloth-zoo's MLX trainer under test: ``unsloth_zoo.mlx.trainer.MLXTrainer`` with its DDP path.

The scenario's model (seeded weights from its config, or a local model directory) and rows go to
``MLXTrainer(model, tokenizer, train_dataset, eval_dataset, args=MLXTrainingConfig(...))``
through its public parameters: rows are pretokenized ``{"input_ids", "labels"}`` dicts (labels
-100 where the scenario supervises nothing, so response-only rows keep their mask). Everything
else is unsloth-zoo's own: its batching (the scenario's ``ordered`` rows in its sequential
order, ``shuffled`` in its default seeded order; rank r taking every N-th row of each global
batch), its token-weighted loss and gradient all-reduce, its compiled local step
(``compile_scope`` ``full_step`` in one process, ``ddp_local_grad`` under DDP), its sharded
evaluation, its failure consensus and its rank-0 saves. Settings the scenario leaves to the
trainer (cut cross-entropy, gradient checkpointing, norm casting) keep unsloth-zoo's defaults.

What the adapter adds: a Hugging Face style callback (``add_callback``), which unsloth-zoo calls
on every rank, reports each logged optimizer step (``logging_steps = 1``: the global loss and
supervised tokens it all-reduced, this rank's tokens, its learning rate, the parameters for
replica digests) and each evaluation. In a floor run the model computes each batch in the ranks'
row chunks (``harness.rank.split_floor.split_text_model``), and in its sequential order the adapter hands each
batch's rows over in reverse order as well (its fused loss then sums them in another order too).

Step-local probes go through unsloth-zoo's own parts, called eagerly: at its ``on_step_begin``
(fired on every rank before the step's first micro-batch is fetched, the model holding the
parameters the step's gradient is taken at) the probe reads the step's micro-batches from the
batch plan the loop trains from (its visits located with ``_mlx_epoch_microbatches`` and
``_mlx_microstep_for_step``, fetched as its eager path fetches them, ``plan[index]`` and
``prepare_cce_batch``), differentiates the loss its factory builds for the run
(``make_cce_loss_fn``, or ``make_baseline_loss_fn`` without cut cross-entropy) with
``nn.value_and_grad``, weights each micro-batch's gradient by its tokens as its step does, sums the
ranks' gradients and tokens with the trainer's own ``_distributed_sum_gradient_tree`` and
``_distributed_all_sum`` and divides (or, in one process with one micro-batch and no clipping,
keeps the raw gradient, as its direct update does); the loss is its reported one (the ranks'
summed loss x tokens over their summed tokens), the tokens its supervised-token count. Not covered:
the step function it builds inside ``train()`` (and compiles) is a closure no caller can reach, so
that glue is replicated; the gradient is taken before its clipping; a streamed run
(``[data] streaming``) draws each micro-batch from its own iterator as it trains, so nothing can
read a step's batches before it does: its step-local checks are "n/a". For the known defects the
probe also hands the harness the step's micro-batches as ``(inputs, targets, mask)``, shifted and
masked as unsloth-zoo's text losses do (``canonical_micros``).

With ``[data] streaming`` the rows go as an unsized stream (``StreamedRows``: no length, no
indexing, read afresh each epoch) with ``streaming=True``; unsloth-zoo reads it on rank 0 alone and
sends each rank its rows (``rows_read`` in each rank's ``data`` says how many it read).

Known behaviours (scenarios ``unsloth_tail_padding`` and ``unsloth_default_order``): under DDP it
pads an epoch's short last global batch with rows from the dataset's start, and in its default
order it batches pretokenized rows without the DDP group (every rank trains on the same rows).

Install: ``pip install --no-deps 'unsloth_zoo>=2026.10.9'`` (its declared dependencies pull
torch and triton on Linux; its MLX trainer needs none of them). On Linux it imports with
``UNSLOTH_ZOO_DISABLE_GPU_INIT=1``, which the adapter sets.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from harness.rank.context import RankContext, ReportedFailure
from harness.rank.reporter import StepReporter
from harness.scenario import Scenario
from harness.scenario.checks import STEP_LOCAL, CheckName
from harness.trainers.unsloth_zoo import TRAINER

TITLE = TRAINER.entry
INSTALL = TRAINER.install
NO_PROBE = ("unsloth-zoo draws a streamed run's micro-batches from its own iterator as it trains: a step's "
            "batches cannot be read before it without consuming its stream")
STREAMED = dict.fromkeys(STEP_LOCAL, NO_PROBE)
NOT_APPLICABLE = {
    CheckName.data_share_bytes: "MLXTrainer takes the whole dataset on every rank and picks each rank's rows itself",
}
LORA_RNG = {CheckName.global_rng_untouched: "the LoRA layers are mlx-lm's, which draw their weights from MLX's "
                                              "global RNG: the adapter seeds it with the scenario seed on every rank"}
SCOPES = {"full_step": "full-step", "ddp_local_grad": "local-grad"}
COMPILE_MODES = {"off": "eager", "strict": "strict", "best_effort": "best_effort"}
SCHEDULES = {"constant": "constant", "cosine": "cosine_warmup_with_min_lr"}
# The scenario's "ordered" rows go in unsloth-zoo's sequential order (global batch k is rows
# k*B..(k+1)*B-1, as the seed PR's own parity test ran it); "shuffled" leaves the order to
# unsloth-zoo's default (a seeded, length-grouped order of its own).
ORDERS = {"ordered": "sequential", "shuffled": "default"}


def available() -> str | None:
    """None when unsloth-zoo's MLX trainer imports here, else why not (with the install line)."""
    os.environ.setdefault("UNSLOTH_ZOO_DISABLE_GPU_INIT", "1")
    try:
        import unsloth_zoo.mlx.trainer  # noqa: F401
    except Exception as e:
        return f"unsloth-zoo's MLX trainer does not import ({type(e).__name__}: {e}); install it with: {INSTALL}"
    return None


def load_libraries(scenario: Scenario) -> None:
    """What every run imports: unsloth-zoo's MLX trainer (``available``) and, once training
    starts, transformers' callback module (its step cadence probes ``DefaultFlowCallback``; with
    torch installed that import brings torch in)."""
    if available() is None:
        import transformers.trainer_callback  # noqa: F401


def warm_imports(scenario: Scenario) -> None:
    """What rank 0 imports at its final save: mlx-lm's saving utilities (through them transformers'
    tokenizer modules, about a second)."""
    if available() is None:
        import mlx_lm.utils  # noqa: F401


def to_item(ex: Any) -> dict[str, list[int]]:
    """A row as ``MLXTrainer`` takes it pretokenized: labels -100 where nothing is supervised."""
    ids = [int(t) for t in ex.ids]
    return {"input_ids": ids, "labels": [t if bool(s) else -100 for t, s in zip(ids, ex.supervised, strict=True)]}


class TokenizerView:
    """The harness's tokenizer as ``MLXTrainer`` reads it when rows come pretokenized: padding and
    end-of-sequence ids, ``encode``, and ``save_pretrained`` for its final save of a full model."""

    def __init__(self, tok: Any, name: str):
        self.tok, self.name = tok, name
        self.pad_token_id = tok.pad_id
        self.eos_token_id = tok.eos_id

    def encode(self, text: str, **_: Any) -> list[int]:
        return self.tok.encode(text)

    def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def save_pretrained(self, path: str) -> None:
        import json

        note = {"harness_tokenizer": self.name, "pad_token_id": self.pad_token_id, "eos_token_id": self.eos_token_id}
        (Path(path) / "tokenizer_config.json").write_text(json.dumps(note))


def training_config(s: Scenario, world: int, out_dir: str) -> Any:
    """``MLXTrainingConfig`` for the scenario: the same global batch, steps, optimizer and schedule."""
    from unsloth_zoo.mlx.trainer import MLXTrainingConfig

    t = s.train
    schedule: dict[str, Any] = {"lr_scheduler_type": SCHEDULES[t.lr_schedule]}
    if t.lr_schedule == "constant" and t.warmup_steps:
        schedule["lr_scheduler_type"] = "constant_with_warmup"
    if t.lr_schedule == "cosine":
        schedule["lr_scheduler_min_lr_rate"] = t.min_lr_ratio
    return MLXTrainingConfig(
        per_device_train_batch_size=t.global_batch // (t.grad_accum * world),
        gradient_accumulation_steps=t.grad_accum, max_steps=t.steps, warmup_steps=t.warmup_steps,
        learning_rate=t.learning_rate, optim=t.optimizer, weight_decay=t.weight_decay,
        # The scenario's clipping: a global norm, or none (unsloth-zoo's own default is a per-leaf cap).
        max_grad_norm=t.max_grad_norm, max_grad_leaf_norm=None if t.max_grad_norm else 0.0,
        logging_steps=1, output_dir=out_dir, report_to="none",
        save_steps=t.checkpoint_every, save_total_limit=t.keep_last or -1,
        eval_steps=t.eval_every, per_device_eval_batch_size=max(1, t.eval_batch // world),
        compile=t.compile != "off", compile_mode=COMPILE_MODES[t.compile], streaming=s.data.streaming,
        dataset_order=ORDERS[s.data.order], max_seq_length=s.data.max_seq_len, seed=s.seed, append_eos=False,
        **schedule)


def reverse_batches(items: Iterable[Any], batch: int) -> Iterator[Any]:
    """The floor run in sequential order: each consecutive ``batch`` of rows reversed, so each of
    unsloth-zoo's batches holds the same rows in reverse order (its loss sums them in another
    order). Reads ``items`` one batch at a time."""
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == batch:
            yield from reversed(chunk)
            chunk = []
    yield from reversed(chunk)


class StreamedRows:
    """The scenario's train rows as an unsized stream, the lazy text source unsloth-zoo's
    ``streaming=True`` takes (``__iter__`` only: no length, no indexing). Each pass reads the row
    source afresh and encodes one row at a time; ``reverse`` > 0 reverses each run of that many
    rows (the floor run's order). ``rows_read`` counts the rows handed over, every pass."""

    def __init__(self, s: Scenario, tok: Any, reverse: int = 0):
        self.s, self.tok, self.reverse = s, tok, reverse
        self.rows_read = 0

    def _items(self) -> Iterator[dict[str, list[int]]]:
        from harness.data.rows import iter_rows

        for _, ex in iter_rows(self.s, self.tok, "train"):
            self.rows_read += 1
            yield to_item(ex)

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        return reverse_batches(self._items(), self.reverse) if self.reverse else self._items()


def step_batches(trainer: Any, step: int) -> list[Any]:
    """Optimizer step ``step``'s micro-batches on this rank, from the batch plan ``train()`` trains
    from, located and fetched as its loop does (eagerly: ``plan[index]``, ``prepare_cce_batch``)."""
    from unsloth_zoo.mlx.trainer import FiniteTextBatchPlan, _mlx_epoch_microbatches, _mlx_microstep_for_step

    plan, args = trainer._text_shape_guard_preflight[0], trainer.args
    accum = max(1, int(args.gradient_accumulation_steps))
    epoch = _mlx_epoch_microbatches(args, plan, includes_epochs=getattr(trainer, "_prepared_batches_include_epochs",
                                                                        False))
    first, end = ((_mlx_microstep_for_step(k, epoch, accum) if epoch else k * accum) for k in (step - 1, step))
    micros = []
    for visit in range(first, end):
        index = plan.batch_index_for_visit(visit) if hasattr(plan, "batch_index_for_visit") else visit % len(plan)
        batch = plan[index]
        micros.append(plan.prepare_cce_batch(index, batch) if isinstance(plan, FiniteTextBatchPlan) else batch)
    return micros


def run_loss(trainer: Any) -> Any:
    """The loss ``train()`` builds for a text run, from its own factory with its settings (when it
    compiles, the compiled variant the factory attaches, if any)."""
    from unsloth_zoo.mlx import trainer as zoo

    args = trainer.args
    smoothing = zoo._validate_label_smoothing(getattr(args, "label_smoothing_factor", 0.0), False)
    if not args.use_cce:
        return zoo.make_baseline_loss_fn(label_smoothing=smoothing)
    loss = zoo.make_cce_loss_fn(trainer.model, label_smoothing=smoothing)
    compiled = getattr(loss, "_unsloth_compiled_loss_fn", None)
    return compiled if args.compile and compiled is not None else loss


def probe_gradient(trainer: Any, loss_fn: Any, micros: list[Any]) -> tuple[Any, Any, int]:
    """unsloth-zoo's step on ``micros`` without its update: each micro-batch's gradient weighted by
    its tokens and summed, the ranks' sums and tokens summed by the trainer's own reductions, scaled
    by one over the tokens (one process, one micro-batch, no clipping: the raw gradient, its direct
    update); its reported loss and supervised tokens. The global RNG is left as it was."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map
    from unsloth_zoo.mlx import trainer as zoo

    args, key = trainer.args, zoo._mlx_rng_key()
    value_and_grad = nn.value_and_grad(trainer.model, loss_fn)
    grad = raw = toks_f = None
    loss_sum = n_tokens = supervised = 0
    for batch in micros:
        (value, toks, *_), g = value_and_grad(trainer.model, *batch)
        f = toks.astype(mx.float32)
        raw = g
        g = tree_map(lambda x, f=f: x * f.astype(x.dtype), g)
        grad, toks_f = (g, f) if grad is None else (tree_map(mx.add, grad, g), toks_f + f)
        loss_sum, n_tokens = loss_sum + value * toks, n_tokens + toks
        supervised = supervised + (loss_fn._unsloth_supervised_tokens(batch)
                                   if hasattr(loss_fn, "_unsloth_supervised_tokens") else toks)
    clipping = zoo._resolve_mlx_grad_clipping(args)[:3]
    rescaled = args.lora_plus_ratio > 0 or args.embedding_learning_rate > 0
    if trainer.distributed_world_size <= 1 and args.gradient_accumulation_steps == 1 and max(clipping) <= 0 \
            and not rescaled:
        grad = raw
    else:
        grad = trainer._distributed_sum_gradient_tree(grad)
        toks_f = mx.maximum(trainer._distributed_all_sum(toks_f), mx.array(1.0, dtype=mx.float32))
        grad = tree_map(lambda x: x * (mx.array(1.0, dtype=mx.float32) / toks_f).astype(x.dtype), grad)
    total = trainer._distributed_all_sum(loss_sum, stream=mx.cpu) / trainer._distributed_all_sum(n_tokens,
                                                                                                 stream=mx.cpu)
    tokens = int(trainer._distributed_all_sum(mx.array(supervised), stream=mx.cpu).item())
    zoo._restore_mlx_rng_key(key)
    return total, grad, tokens


def canonical_micros(micros: list[Any]) -> list[tuple[Any, Any, Any]]:
    """unsloth-zoo's micro-batches ``(ids, lengths, labels[, cce_indices])`` as ``(inputs, targets,
    mask)`` (``harness.rank.defects``), as its text losses (``make_cce_loss_fn``,
    ``make_baseline_loss_fn``) take them: inputs all but the last id, targets the labels (the ids
    where a batch has none) after the first; the mask the targets from each row's offset to before
    its length (``1 + j`` in ``[offset, length)``) whose label is not -100 (masked targets become 0,
    as its baseline loss makes them). Its CCE compaction indices select exactly these targets."""
    import mlx.core as mx

    out = []
    for batch in micros:
        ids, lengths, labels = batch[0], batch[1], batch[2] if len(batch) > 2 else None
        targets = (ids if labels is None else labels)[:, 1:]
        steps = mx.arange(1, targets.shape[1] + 1)
        mask = mx.logical_and(mx.logical_and(steps >= lengths[:, 0:1], steps < lengths[:, 1:]), targets != -100)
        targets = mx.where(targets == -100, mx.array(0, dtype=targets.dtype), targets)
        out.append((ids[:, :-1], targets, mask.astype(mx.float32)))
    return out


def make_callback(rep: StepReporter, trainer: Any, eval_tokens: int, probes: bool = True) -> Any:
    """The callback unsloth-zoo calls on every rank before each optimizer step (a step-local probe
    there when the job plans one), and after each log and evaluation."""
    loss: list[Any] = []  # the run's loss, built at the first probe

    class Report:
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            step = int(state.global_step) + 1
            if step == rep.done + 1:  # after unsloth-zoo's own setup, which keeps norm weights float32
                rep.first_step(trainer.model.parameters())
            if probes and step in rep.probes.steps:
                if not loss:
                    loss.append(run_loss(trainer))
                micros = step_batches(trainer, step)
                rep.probe(step, trainer.model, lambda: probe_gradient(trainer, loss[0], micros),
                          lambda: canonical_micros(micros))

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if not logs or "loss" not in logs or "eval_loss" in logs or "train_runtime" in logs:
                return
            rep.step(int(state.global_step), logs["loss"], trainer._global_token_count_history[-1],
                     trainer._local_token_count_history[-1], lr=logs.get("learning_rate"),
                     params=trainer.model.parameters)

        def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, Any] | None = None,
                        **kw: Any) -> None:
            if metrics and "eval_loss" in metrics:
                rep.eval(int(state.global_step), metrics["eval_loss"], eval_tokens)

    return Report()


def run(ctx: RankContext) -> dict[str, Any]:
    why = available()
    if why is not None:
        raise ReportedFailure(f"trainer {TRAINER.kind}: {why}")
    from importlib.metadata import version

    from unsloth_zoo.mlx.trainer import MLXTrainer

    from harness.data.rows import load_rows
    from harness.rank.models import apply_lora, build_model
    from harness.rank.split_floor import split_floor, split_text_model

    s = ctx.job.scenario
    lora = s.trainer.fine_tune == "lora"
    streaming = s.data.streaming
    rep = StepReporter(ctx, s, {**NOT_APPLICABLE, **(LORA_RNG if lora else {}), **(STREAMED if streaming else {})})
    ctx.phase("data")
    rows = load_rows(s, train=not streaming)
    plan = split_floor(ctx.job, s.seed)
    reverse = s.train.global_batch // s.train.grad_accum if plan and s.data.order == "ordered" else 0
    train: Any
    if streaming:  # read lazily, by unsloth-zoo, on every rank
        train = rep.stream = StreamedRows(s, rows.tokenizer, reverse)
    else:
        train = [to_item(ex) for _, ex in rows.train]
        rep.data_bytes = sum(16 * len(item["input_ids"]) for item in train)  # as Python ints: a lower bound
        train = list(reverse_batches(train, reverse)) if reverse else train
    eval_items = [to_item(ex) for _, ex in rows.eval] or None
    eval_tokens = sum(ex.tokens for _, ex in rows.eval)
    ctx.phase("model")
    model, config = build_model(s.model, rows.vocab_size, s.seed)
    if lora:
        apply_lora(model, s)
    rep.saw_model(model)  # its dtype, frozen weights included, and a LoRA run's base
    if plan is not None:
        split_text_model(model, plan)
    out = Path(ctx.run_dir) / f"rank{ctx.rank}.unsloth_zoo"
    out.mkdir(exist_ok=True)
    args = training_config(s, ctx.world_size, str(out))
    try:
        tokenizer = TokenizerView(rows.tokenizer, s.data.tokenizer)
        trainer = MLXTrainer(model, tokenizer, train, eval_dataset=eval_items, args=args)
        trainer.add_callback(make_callback(rep, trainer, eval_tokens, probes=not streaming))
        rep.start(model.parameters())
        result = trainer.train()
    except ReportedFailure:
        raise
    except Exception as e:
        raise ReportedFailure(f"trainer {TRAINER.kind} ({TITLE}) raised {type(e).__name__}: {e}") from e
    rep.saved(sum(1 for f in out.rglob("*") if f.is_file()))
    scope = "fallback-eager" if result.get("compile_fallback") else SCOPES.get(result.get("compile_scope"), "none")
    rep.compile_scope = scope if args.compile else "none"
    rep.fallback_reason = result.get("compile_fallback_reason") or None
    trained = model.trainable_parameters() if lora else model.parameters()
    return rep.finish(trained, {"model_config": config, "trainer": {
        "kind": TRAINER.kind, "title": TITLE, "version": version(TRAINER.package),
        "compile_scope": result.get("compile_scope")}})
