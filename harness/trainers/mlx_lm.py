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
  chunks (``common.split_text_model``);
- numpy's and MLX's global RNGs are seeded with the scenario seed on every rank, because mlx-lm
  draws its batch order from numpy's global RNG (and LoRA weights from MLX's): without it the
  ranks would train on different batches;
- the callback reports each optimizer step (``steps_per_report`` = ``grad_accum``): mlx-lm's
  global loss (the mean of the ranks' mean losses), the global tokens it counted, its learning
  rate, and the parameters for replica digests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.rank.entry import RankContext, ReportedFailure
from harness.rank.reporter import StepReporter
from harness.scenario import Scenario
from harness.trainers.common import apply_lora, split_text_model

TITLE = "mlx_lm.tuner.trainer.train"
NO_GRADIENT = "mlx-lm's trainer exposes no loss or gradient at given parameters"
NOT_APPLICABLE = {
    "step_token_parity": NO_GRADIENT,
    "step_loss_parity": NO_GRADIENT,
    "step_grad_parity": NO_GRADIENT,
    "data_share_bytes": "mlx-lm's train() takes the whole dataset on every rank and indexes each rank's rows",
    "global_rng_untouched": "mlx-lm draws its batch order from numpy's global RNG: the adapter seeds it (and MLX's) "
                            "with the scenario seed on every rank",
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
    from harness.trainers.common import load_rows

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


class Batches:
    """mlx-lm's ``iterate_batches``, counting each batch's supervised tokens on this rank."""

    def __init__(self, train_set: Any):
        self.train_set = train_set
        self.train_tokens: list[int] = []
        self.eval_tokens = 0

    def __call__(self, dataset: Any, batch_size: int, max_seq_length: int, loop: bool = False, seed: Any = None,
                 comm_group: Any = None) -> Any:
        from mlx_lm.tuner.trainer import iterate_batches

        for batch, lengths in iterate_batches(dataset=dataset, batch_size=batch_size, max_seq_length=max_seq_length,
                                              loop=loop, seed=seed, comm_group=comm_group):
            count = supervised_tokens(lengths, batch.shape[1])
            if dataset is self.train_set:
                self.train_tokens.append(count)
            else:
                self.eval_tokens += count
            yield batch, lengths


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
            rep.step(int(info["iteration"]) // accum, info["train_loss"], tokens, local, lr=info["learning_rate"],
                     params=model.parameters(), step_time_s=accum / info["iterations_per_second"])

        def on_val_loss_report(self, info: dict[str, Any]) -> None:
            import mlx.core as mx

            tokens = int(mx.distributed.all_sum(mx.array(batches.eval_tokens), stream=mx.cpu).item())
            batches.eval_tokens = 0
            rep.eval(int(info["iteration"]) // accum, info["val_loss"], tokens)

    return Report()


def run(ctx: RankContext) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    from harness.rank.models import build_model
    from harness.rank.step import build_optimizer

    s = Scenario.from_dict(ctx.job["scenario"])
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
    saves = Path(ctx.run_dir) / f"rank{ctx.rank}.mlx_lm"
    saves.mkdir(exist_ok=True)
    accum = t.grad_accum
    iters = t.steps * accum
    args = TrainingArgs(batch_size=t.global_batch // accum, iters=iters, val_batches=-1, steps_per_report=accum,
                        steps_per_eval=t.eval_every * accum if t.eval_every else iters + 1,
                        steps_per_save=t.checkpoint_every * accum if t.checkpoint_every else iters + 1,
                        max_seq_length=s.data.max_seq_len, adapter_file=str(saves / "adapters.safetensors"),
                        grad_accumulation_steps=accum)
    if ctx.job.get("split_rows"):
        split_text_model(model, int(ctx.job["split_rows"]))
    batches = Batches(train_set)
    rep.start(model.parameters())
    try:
        train(model, build_optimizer(t), train_set, eval_set or None, args, iterate_batches=batches,
              training_callback=make_callback(rep, batches, model, accum))
    except ReportedFailure:
        raise
    except Exception as e:
        raise ReportedFailure(f"trainer mlx_lm ({TITLE}) raised {type(e).__name__}: {e}") from e
    rep.saved(sum(1 for f in saves.iterdir() if f.suffix == ".safetensors"))
    trained = model.trainable_parameters() if lora else model.parameters()
    from importlib.metadata import version

    return rep.finish(trained, {"model_config": config, "trainer": {
        "kind": "mlx_lm", "title": TITLE, "version": version("mlx-lm"), "fine_tune": s.trainer.fine_tune}})
