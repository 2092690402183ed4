"""mlx-lm's trainer under test: ``mlx_lm.tuner.trainer.train``, full fine-tuning or LoRA.

The scenario's model (built from its config with seeded weights, or a local model directory)
and rows (tokenized with the scenario's tokenizer) go to ``train`` through its public
parameters: a model object, in-memory datasets of ``(token_ids, offset)`` rows, ``TrainingArgs``
and a ``TrainingCallback``. Everything else is mlx-lm's own: its batching (rows sorted by length,
rank r taking every N-th row of each global batch), its ``default_loss``, its compiled step with
``average_gradients``, its reporting, its evaluation and its rank-0 adapter saves.

What the adapter adds:
- ``iterate_batches`` is mlx-lm's own, wrapped to count each rank's supervised tokens (with
  ``default_loss``'s mask); in a floor run the model computes each batch in the ranks' row
  chunks (``harness.rank.split_floor.split_text_model``);
- numpy's and MLX's global RNGs are seeded with the scenario seed on every rank, because mlx-lm
  draws its batch order from numpy's global RNG (and LoRA weights from MLX's): without it the
  ranks would train on different batches;
- the callback reports each optimizer step (``steps_per_report`` = ``grad_accum``): mlx-lm's
  global loss (the mean of the ranks' mean losses), the global tokens it counted, its learning
  rate, and the parameters for replica digests.

Checkpoints and resume are mlx-lm's adapter files. Its saves (``adapters.safetensors`` and
``NNNNNNN_adapters.safetensors`` every ``steps_per_save`` iterations, rank 0 only) go to the
run's checkpoint directory, one folder per rank; a run that stops early also notes which step its
final ``adapters.safetensors`` holds (mlx-lm's name for it carries none). A resumed run does what
``mlx_lm.lora --resume-adapter-file`` does: it loads the newest (or the requested) adapter file
into the model and trains the remaining iterations. mlx-lm saves nothing else, so the resumed
run starts with a fresh optimizer (moments, step count, schedule position) and its batch order
from the beginning: that is mlx-lm's resume, and the harness judges it as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.rank.context import RankContext, ReportedFailure
from harness.rank.models import apply_lora
from harness.rank.reporter import StepReporter
from harness.rank.split_floor import split_floor, split_text_model
from harness.scenario import Scenario
from harness.scenario.checks import CheckName
from harness.trainers.mlx_lm import TRAINER

TITLE = TRAINER.entry
NOT_APPLICABLE = {
    CheckName.data_share_bytes: "mlx-lm's train() takes the whole dataset on every rank and indexes each rank's rows",
    CheckName.global_rng_untouched: "mlx-lm draws its batch order from numpy's global RNG: the adapter seeds it "
                                    "(and MLX's) with the scenario seed on every rank",
}


def to_row(ids: Any, supervised: Any, where: str) -> tuple[list[int], int]:
    """A tokenized row as mlx-lm takes it: ``(token_ids, offset)``; its loss supervises the
    targets from ``offset`` to the row's end, so trailing unsupervised tokens are dropped and a
    row supervised in several spans is refused."""
    import numpy as np

    at = np.flatnonzero(supervised)
    if at.size == 0:
        raise ValueError(f"{where}: no supervised tokens")
    first, last = int(at[0]), int(at[-1])
    if not bool(np.all(supervised[first : last + 1])):
        raise ValueError(f"{where}: supervised in several spans; mlx-lm supervises one suffix of each row (an offset)")
    return [int(t) for t in ids[: last + 1]], first


def datasets(s: Scenario) -> tuple[list[tuple[list[int], int]], list[tuple[list[int], int]], int]:
    """(train rows, eval rows, vocabulary size) from the scenario's data and tokenizer."""
    from harness.data.rows import load_rows

    rows = load_rows(s)

    def convert(split: list[tuple[str, Any]]) -> list[tuple[list[int], int]]:
        return [to_row(ex.ids, ex.supervised, where) for where, ex in split]

    return convert(rows.train), convert(rows.eval), rows.vocab_size


def supervised_tokens(lengths: Any, width: int) -> int:
    """The tokens ``default_loss`` counts in a batch of ``width`` columns: targets 1..width-1
    between each row's offset and length."""
    import numpy as np

    lengths = np.array(lengths)
    steps = np.arange(1, width)
    return int(np.sum((steps >= lengths[:, :1]) & (steps <= lengths[:, 1:])))


class RankZeroView:
    """The rank's group as the ``same_rows`` mutation shows it to mlx-lm's ``iterate_batches``:
    rank 0 of the same size, so that every rank takes rank 0's rows."""

    def __init__(self, group: Any):
        self.group = group

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self.group.size()


class Batches:
    """mlx-lm's ``iterate_batches``, counting each batch's supervised tokens on this rank and
    handing each training micro-batch's input width (padding included: mlx-lm's inputs are
    ``batch[:, :-1]``) to ``width``; before the first micro-batch of a step the job probes, it
    hands that step's micro-batches to ``probe(step, micros)`` (the model then holds the
    parameters the step's gradient is taken at)."""

    def __init__(self, train_set: Any, accum: int = 1, first_step: int = 1,
                 probe: Callable[[int, list[Any]], None] | None = None, probe_steps: Any = (),
                 width: Callable[[int], None] | None = None):
        self.train_set = train_set
        self.train_tokens: list[int] = []
        self.eval_tokens = 0
        self.accum, self.first_step = accum, first_step
        self.probe, self.probe_steps = probe, set(probe_steps)
        self.yielded = 0  # training micro-batches handed to the trainer
        self.width = width
        self.eval_s = 0.0  # time spent evaluating since the last step was reported
        self.same_rows = False  # the ``same_rows`` mutation: every rank given rank 0's rows

    def _count(self, dataset: Any, batch: Any, lengths: Any) -> tuple[Any, Any]:
        count = supervised_tokens(lengths, batch.shape[1])
        if dataset is self.train_set:
            self.train_tokens.append(count)
            self.yielded += 1
            if self.width is not None:
                self.width(batch.shape[1] - 1)
        else:
            self.eval_tokens += count
        return batch, lengths

    def __call__(self, dataset: Any, batch_size: int, max_seq_length: int, loop: bool = False, seed: Any = None,
                 comm_group: Any = None) -> Any:
        from mlx_lm.tuner.trainer import iterate_batches

        started = time.perf_counter()
        if self.same_rows and comm_group is not None:
            comm_group = RankZeroView(comm_group)
        it = iterate_batches(dataset=dataset, batch_size=batch_size, max_seq_length=max_seq_length, loop=loop,
                             seed=seed, comm_group=comm_group)
        for batch, lengths in it:
            step = self.first_step + self.yielded // self.accum
            if dataset is self.train_set and self.yielded % self.accum == 0 and step in self.probe_steps \
                    and self.probe is not None:
                micros = [(batch, lengths), *(next(it) for _ in range(self.accum - 1))]
                self.probe(step, micros)
                for b, n in micros:
                    yield self._count(dataset, b, n)
                continue
            yield self._count(dataset, batch, lengths)
        if dataset is not self.train_set:  # an evaluation drew all its batches: not a step's time
            self.eval_s += time.perf_counter() - started


def canonical_micros(micros: list[Any]) -> list[tuple[Any, Any, Any]]:
    """mlx-lm's micro-batches as ``(inputs, targets, mask)``, the mask ``default_loss``'s: the
    targets from each row's offset to its length (``harness.rank.defects``)."""
    import mlx.core as mx

    out = []
    for batch, lengths in micros:
        steps = mx.arange(1, batch.shape[1])
        mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:]).astype(mx.float32)
        out.append((batch[:, :-1], batch[:, 1:], mask))
    return out


def probe_gradient(model: Any, loss: Any, micros: list[Any], world_size: int) -> tuple[Any, Any, int]:
    """mlx-lm's step on ``micros`` without its update, through its own parts: the ``loss`` it
    trains with, its gradient summed over the micro-batches, ``average_gradients`` as its trainer
    imports it, the division by the micro-batch count, and its reported loss (the all-summed
    micro-batch losses over micro-batches x world size) and token count."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map
    from mlx_lm.tuner import trainer

    value_and_grad = nn.value_and_grad(model, loss)
    grad, loss_sum, tokens = None, mx.array(0.0), mx.array(0)
    for batch, lengths in micros:
        (value, toks), g = value_and_grad(model, batch, lengths)
        grad = g if grad is None else tree_map(lambda x, y: x + y, grad, g)
        loss_sum, tokens = loss_sum + value, tokens + toks
    grad = trainer.average_gradients(grad)
    if len(micros) > 1:
        grad = tree_map(lambda x: x / len(micros), grad)
    total = mx.distributed.all_sum(loss_sum, stream=mx.cpu) / (len(micros) * world_size)
    return total, grad, int(mx.distributed.all_sum(tokens, stream=mx.cpu).item())


def make_callback(rep: StepReporter, batches: Batches, model: Any, accum: int) -> Any:
    from mlx_lm.tuner.callbacks import TrainingCallback

    class Report(TrainingCallback):
        def __init__(self) -> None:
            self.trained = 0

        def on_train_loss_report(self, info: dict[str, Any]) -> None:
            tokens = int(info["trained_tokens"]) - self.trained
            self.trained = int(info["trained_tokens"])
            local = sum(batches.train_tokens[:accum])
            del batches.train_tokens[:accum]
            # the step's wall time, as the harness times every trainer (mlx-lm's own figure leaves
            # out its batching and reporting), less evaluations and probes
            dt = time.perf_counter() - rep.t_last - batches.eval_s - rep.probe_s
            batches.eval_s = 0.0
            rep.step(rep.done + int(info["iteration"]) // accum, info["train_loss"], tokens, local,
                     lr=info["learning_rate"], params=model.parameters, step_time_s=dt)

        def on_val_loss_report(self, info: dict[str, Any]) -> None:
            import mlx.core as mx

            tokens = int(mx.distributed.all_sum(mx.array(batches.eval_tokens), stream=mx.cpu).item())
            batches.eval_tokens = 0
            rep.eval(rep.done + int(info["iteration"]) // accum, info["val_loss"], tokens)

    return Report()


ADAPTERS = "adapters.safetensors"
FINAL_STEP = "adapters_step.json"  # which optimizer step the final adapters.safetensors holds


def saves_dir(ctx: RankContext) -> Path:
    """Where this rank's mlx-lm saves go: the run's checkpoint directory (a folder per rank), or
    the run directory when the scenario keeps no checkpoints of this run."""
    root = Path(ctx.job.checkpoint_dir or ctx.run_dir)
    path = root / f"rank{ctx.rank}.mlx_lm"
    path.mkdir(parents=True, exist_ok=True)
    return path


def saved_adapters(folder: Path, accum: int) -> dict[int, Path]:
    """Optimizer step -> the adapter file mlx-lm saved after it, in one folder."""
    import json

    found: dict[int, Path] = {}
    for f in folder.glob(f"*_{ADAPTERS}"):
        it = f.name.split("_", 1)[0]
        if it.isdigit() and int(it) % accum == 0:
            found[int(it) // accum] = f
    note = folder / FINAL_STEP
    if note.exists() and (folder / ADAPTERS).exists():
        found.setdefault(int(json.loads(note.read_text())["step"]), folder / ADAPTERS)
    return found


def pick_adapters(source: Path, step: int | None, accum: int) -> tuple[int, Path]:
    """The adapter file to resume from: ``step``'s, or the newest, in ``source`` (a run's checkpoint
    directory, whose rank 0 folder holds mlx-lm's saves, or a folder of adapter files)."""
    folder = source / "rank0.mlx_lm" if (source / "rank0.mlx_lm").is_dir() else source
    found = saved_adapters(folder, accum) if folder.is_dir() else {}
    if not found:
        raise ValueError(f"no adapter file to resume from in {folder} (mlx-lm saves NNNNNNN_{ADAPTERS} every "
                         f"steps_per_save iterations)")
    if step is None:
        step = max(found)
    if step not in found:
        raise ValueError(f"no adapter file of step {step} in {folder}; it has steps {sorted(found)}")
    return step, found[step]


def check_resume_source(source: Path, step: int | None, s: Scenario) -> None:
    """Before anything starts: ``source`` (a directory a run resumes from) has a readable adapter
    file to resume from (ValueError naming what is missing or damaged)."""
    import mlx.core as mx

    _, path = pick_adapters(source, step, s.train.grad_accum)
    try:
        mx.load(str(path))
    except Exception as e:
        raise ValueError(f"cannot read adapter file {path}: {e}") from e


def load_adapters(model: Any, path: Path) -> str:
    """Load ``path`` into ``model`` as ``mlx_lm.lora --resume-adapter-file`` does, after checking it
    holds exactly the model's trainable parameters; returns its identity (name and digest)."""
    import hashlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    try:
        weights = mx.load(str(path))
    except Exception as e:
        raise ReportedFailure(f"trainer {TRAINER.kind}: cannot read adapter file {path}: {e}") from e
    wanted = {k: v.shape for k, v in tree_flatten(model.trainable_parameters())}
    got = {k: v.shape for k, v in weights.items()}
    if got != wanted:
        missing, extra = sorted(wanted.keys() - got.keys()), sorted(got.keys() - wanted.keys())
        shapes = sorted(k for k in wanted.keys() & got.keys() if wanted[k] != got[k])
        raise ReportedFailure(f"trainer {TRAINER.kind}: adapter file {path} does not fit the model's trainable "
                              f"parameters (missing {missing[:3]}, unexpected {extra[:3]}, other shapes {shapes[:3]})")
    model.load_weights(list(weights.items()), strict=False)
    return f"{path.name} ({hashlib.sha256(path.read_bytes()).hexdigest()[:12]})"


def load_libraries(scenario: Scenario) -> None:
    """What every run imports: mlx-lm's trainer and, through it, transformers."""
    import mlx_lm.tuner.trainer  # noqa: F401


def run(ctx: RankContext) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    from harness.rank.models import build_model
    from harness.rank.optimizer import build_optimizer

    s = ctx.job.scenario
    t, lora = s.train, s.trainer.fine_tune == "lora"
    rep = StepReporter(ctx, s, NOT_APPLICABLE, compile_scope="full-step")
    ctx.phase("data")
    train_set, eval_set, vocab = datasets(s)
    rep.data_bytes = sum(8 * len(ids) + 8 for ids, _ in train_set)  # as Python ints: a lower bound
    ctx.phase("model")
    model, config = build_model(s.model, vocab, s.seed)
    np.random.seed(s.seed)  # mlx-lm's batch order (see the module docstring)
    mx.random.seed(s.seed)
    from mlx_lm.tuner.trainer import TrainingArgs, train

    if lora:
        apply_lora(model, s)
    rep.saw_model(model)  # its dtype, frozen weights included, and a LoRA run's base
    accum = t.grad_accum
    end = ctx.job.stop_after or t.steps
    if ctx.job.resume is not None:
        ctx.phase("resume")
        try:
            done, path = pick_adapters(Path(ctx.job.resume.source), ctx.job.resume.step, accum)
        except ValueError as e:
            raise ReportedFailure(f"trainer {TRAINER.kind}: {e}") from e
        rep.resumed(done, {"identity": load_adapters(model, path), "file": str(path), "seed_scenario": s.seed,
                           "restored": "adapter weights only (mlx-lm saves no optimizer state, step or data "
                                       "position)"})
    saves = saves_dir(ctx)
    iters = (end - rep.done) * accum
    if iters <= 0:
        raise ReportedFailure(f"trainer {TRAINER.kind}: resumed after step {rep.done}, nothing left of {end} steps")
    args = TrainingArgs(batch_size=t.global_batch // accum, iters=iters, val_batches=-1, steps_per_report=accum,
                        steps_per_eval=t.eval_every * accum if t.eval_every else iters + 1,
                        steps_per_save=t.checkpoint_every * accum if t.checkpoint_every else iters + 1,
                        max_seq_length=s.data.max_seq_len, adapter_file=str(saves / ADAPTERS),
                        grad_accumulation_steps=accum)
    if (plan := split_floor(ctx.job, s.seed)) is not None:
        split_text_model(model, plan)
    from mlx_lm.tuner.trainer import default_loss

    def probe(step: int, micros: list[Any]) -> None:
        rep.probe(step, model, lambda: probe_gradient(model, default_loss, micros, ctx.world_size),
                  lambda: canonical_micros(micros))

    batches = Batches(train_set, accum, rep.done + 1, probe, rep.probes.steps, rep.width)
    batches.same_rows = ctx.job.mutation == "same_rows"
    rep.start(model.parameters())
    try:
        train(model, build_optimizer(t), train_set, eval_set or None, args, loss=default_loss,
              iterate_batches=batches, training_callback=make_callback(rep, batches, model, accum))
    except ReportedFailure:
        raise
    except Exception as e:
        raise ReportedFailure(f"trainer {TRAINER.kind} ({TITLE}) raised {type(e).__name__}: {e}") from e
    if (saves / ADAPTERS).exists():
        import json

        (saves / FINAL_STEP).write_text(json.dumps({"step": rep.steps}))
    rep.saved(sum(1 for f in saves.iterdir() if f.suffix == ".safetensors"))
    trained = model.trainable_parameters() if lora else model.parameters()
    from importlib.metadata import version

    return rep.finish(trained, {"model_config": config, "trainer": {
        "kind": TRAINER.kind, "title": TITLE, "version": version(TRAINER.package), "fine_tune": s.trainer.fine_tune}})
