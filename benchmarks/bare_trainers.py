"""Each trainer run bare, as a user runs it, on the model, rows and optimizer the harness builds
for the same run (``observer_effect.py``'s bare side, in a process of its own): each writes its
rank-0 timestamps (step, time, global supervised tokens) to a file. Which call each trainer's
bare side makes, and where its clock reads: ``observer_effect.py``'s docstring."""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import timed_script

from harness.rank import turns  # the turns of ``observer_effect.py --turns``, where taken


def report_clock(base: type, marks: list[dict[str, Any]]) -> Any:
    """A callback of ``base`` (mlx-vlm's ``TrainingCallback``) that takes one timestamp
    per loss report, with the trained tokens it reports, and does nothing else."""

    class Clock(base):  # type: ignore[misc, valid-type]
        def on_train_loss_report(self, info: dict[str, Any]) -> None:
            marks.append({"step": info["iteration"], "time": time.time(), "tokens": info["trained_tokens"]})
            turns.after(info["iteration"])

    return Clock()


class FetchClock:
    """Bare mlx-lm's clock: the end of each training step, marked where mlx-lm's loop asks for the
    next batch (after the step's evaluation and any report) and before that batch is built, as the
    harness marks a step at its report; so every step is marked whatever its ``steps_per_report``,
    and the last step at its final report. A step adds a timestamp and the turn it waits for,
    nothing else: its tokens (one process: the global ones) are counted after training, from each
    batch's lengths as ``default_loss`` counts them, and checked against mlx-lm's own reports. An
    evaluation's batches (``loop`` false) pass unmarked."""

    def __init__(self, steps: int):
        self.steps = steps
        self.marks: list[dict[str, Any]] = []
        self.batches: list[tuple[Any, int]] = []  # each training batch's lengths and width
        self.reported: dict[int, int] = {}  # mlx-lm's trained tokens at each of its reports

    def iterate_batches(self, **kw: Any) -> Any:
        from mlx_lm.tuner.trainer import iterate_batches

        batches = iterate_batches(**kw)
        if not kw.get("loop"):  # an evaluation's
            yield from batches
            return
        for done in itertools.count():
            if done:
                self.mark(done)
            batch, lengths = next(batches)
            self.batches.append((lengths, batch.shape[1]))
            yield batch, lengths

    def mark(self, step: int) -> None:
        self.marks.append({"step": step, "time": time.time()})
        turns.after(step)

    def callback(self, base: type) -> Any:
        clock = self

        class Reports(base):  # type: ignore[misc, valid-type]
            def on_train_loss_report(self, info: dict[str, Any]) -> None:
                clock.reported[int(info["iteration"])] = int(info["trained_tokens"])
                if info["iteration"] == clock.steps:  # no batch is fetched after the last step
                    clock.mark(clock.steps)

        return Reports()

    def counted(self) -> list[dict[str, Any]]:
        """The marks with the global supervised tokens trained by each; SystemExit in one line where
        a count differs from mlx-lm's report at the same step."""
        import numpy as np

        from harness.trainers.mlx_lm.rank import supervised_tokens

        total = np.cumsum([supervised_tokens(np.array(lengths), width) for lengths, width in self.batches])
        for step, tokens in self.reported.items():
            if int(total[step - 1]) != tokens:
                raise SystemExit(f"bare mlx-lm: {int(total[step - 1])} supervised tokens counted by step {step}, "
                                 f"mlx-lm reported {tokens}")
        return [{**m, "tokens": int(total[m["step"] - 1])} for m in self.marks]


def bare_mlx_lm(path: Path, run: str, out: Path, every_step: bool = False) -> None:
    """mlx-lm's ``train`` as a user calls it (its reports every 10 steps; with ``every_step``, every
    step, as the harness's adapter has it report), on the run's model and rows, timed by a
    ``FetchClock``: the time of each step and the tokens trained by it to ``out``."""
    import mlx.core as mx
    import numpy as np

    from harness.rank.models import build_model
    from harness.rank.optimizer import build_optimizer
    from harness.scenario import load_scenario
    from harness.scenario.plan import plan_scenario
    from harness.trainers.mlx_lm.rank import datasets

    s = plan_scenario(load_scenario(path)).run(run).eff
    train_set, _, vocab = datasets(s)
    model, _ = build_model(s.model, vocab, s.seed)
    np.random.seed(s.seed)
    mx.random.seed(s.seed)
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.trainer import TrainingArgs, train

    t = s.train
    clock = FetchClock(t.steps)
    with tempfile.TemporaryDirectory() as d:
        args = TrainingArgs(batch_size=t.global_batch, iters=t.steps, steps_per_eval=t.steps + 1,
                            steps_per_save=t.steps + 1, max_seq_length=s.data.max_seq_len,
                            adapter_file=str(Path(d) / "adapters.safetensors"),
                            **({"steps_per_report": 1} if every_step else {}))
        train(model, build_optimizer(t), train_set, None, args, iterate_batches=clock.iterate_batches,
              training_callback=clock.callback(TrainingCallback))
    turns.hand_on()
    out.write_text(json.dumps(clock.counted()))


def bare_mlx_vlm(path: Path, run: str, out: Path) -> None:
    """mlx-vlm's ``Trainer`` as a user calls it on prepared rows (its defaults: ``steps_per_report``
    10, its own SFT task and batch iterator), on the run's model and image rows; the time of each
    of its reports (every 10 steps) and its ``trained_tokens`` to ``out``, the last step's time
    taken when ``train()`` returns: the adapter reports its last step only then, after mlx-vlm's
    final save of the trainable weights, so both windows hold that save."""
    from harness.rank.models import build_model
    from harness.rank.optimizer import build_optimizer
    from harness.scenario import load_scenario
    from harness.scenario.plan import plan_scenario
    from harness.trainers.common import load_image_rows
    from harness.trainers.mlx_vlm.rank import to_item

    s = plan_scenario(load_scenario(path)).run(run).eff
    rows, vision = load_image_rows(s)
    train_set = [to_item(ex) for _, ex in rows.train]
    model, _ = build_model(s.model, rows.vocab_size, s.seed, vision)
    from mlx_vlm.trainer import Trainer, TrainingCallback, VLMTrainingArgs

    marks: list[dict[str, Any]] = []
    t = s.train
    with tempfile.TemporaryDirectory() as d:
        args = VLMTrainingArgs(batch_size=t.global_batch, iters=t.steps, steps_per_save=t.steps + 1,
                               adapter_file=str(Path(d) / "adapters.safetensors"), max_seq_length=s.data.max_seq_len,
                               pad_token_id=rows.tokenizer.pad_id, train_on_completions=True)
        Trainer(model, args, train_dataset=train_set, optimizer=build_optimizer(t), prepared=True,
                training_callback=report_clock(TrainingCallback, marks), seed=s.seed).train()
    marks[-1]["time"] = time.time()  # after its final save, as the adapter's last step event
    out.write_text(json.dumps(marks))


def bare_unsloth_zoo(path: Path, run: str, out: Path) -> None:
    """unsloth-zoo's ``MLXTrainer`` as a user calls it on pretokenized rows (the run's
    ``MLXTrainingConfig``, as the adapter builds it: ``logging_steps`` 1 is its default too), on the
    run's model and rows; the time of each logged step and its ``trained_tokens`` (through its own
    ``add_step_callback``, no Hugging Face callback) to ``out``. ``transformers.trainer_callback`` is
    imported before training, as the adapter's ``load_libraries`` imports it: unsloth-zoo imports it
    at its last step (probing ``DefaultFlowCallback``), half a second on a CPU that would otherwise
    fall in the bare window only."""
    os.environ.setdefault("UNSLOTH_ZOO_DISABLE_GPU_INIT", "1")
    from harness.data.rows import load_rows
    from harness.rank.models import build_model
    from harness.scenario import load_scenario
    from harness.scenario.plan import plan_scenario
    from harness.trainers.unsloth_zoo.rank import TokenizerView, to_item, training_config

    s = plan_scenario(load_scenario(path)).run(run).eff
    rows = load_rows(s)
    train_set = [to_item(ex) for _, ex in rows.train]
    model, _ = build_model(s.model, rows.vocab_size, s.seed)
    import transformers.trainer_callback  # noqa: F401  (as the adapter's load_libraries: see the docstring)
    from unsloth_zoo.mlx.trainer import MLXTrainer

    marks: list[dict[str, Any]] = []

    def clock(step: int, total: int, loss: float, lr: float, tok_s: float, peak: float, elapsed: float,
              tokens: int, grad_norm: float | None = None) -> None:  # one timestamp per logged step
        marks.append({"step": step, "time": time.time(), "tokens": tokens})
        turns.after(step)

    with tempfile.TemporaryDirectory() as d:
        trainer = MLXTrainer(model, TokenizerView(rows.tokenizer, s.data.tokenizer), train_set,
                             args=training_config(s, 1, d))
        trainer.add_step_callback(clock)
        trainer.train()
    turns.hand_on()
    out.write_text(json.dumps(marks))


class BareSession:
    """What ``api.session()`` gives the script in a bare process: the scenario's model, rows and
    optimizer, built as the harness builds them; ``probe``, ``saved`` and ``finish`` do nothing,
    ``step`` takes a timestamp."""

    def __init__(self, s: Any, run_dir: Path):
        self.scenario, self.run_dir = s, run_dir
        self.rank, self.world_size, self.split_rows = 0, 1, 1
        self.seed, self.steps, self.global_batch = s.seed, s.train.steps, s.train.global_batch
        self.learning_rate = s.train.learning_rate
        self.marks: list[dict[str, Any]] = []
        self.tokens = 0

    def model(self) -> Any:
        from harness.data.tokenizers import load_tokenizer
        from harness.rank.models import build_model

        return build_model(self.scenario.model, load_tokenizer(self.scenario.data).vocab_size, self.seed)[0]

    def rows(self, split: str = "train") -> list[tuple[Any, Any]]:
        from harness.data.rows import split_rows
        from harness.data.tokenizers import load_tokenizer

        tok = load_tokenizer(self.scenario.data)
        return [(e.ids, e.supervised) for _, e in split_rows(self.scenario, tok, split)]

    def optimizer(self) -> Any:
        from harness.rank.optimizer import build_optimizer

        return build_optimizer(self.scenario.train)

    def probe(self, *args: Any) -> None:
        pass

    def step(self, step: int, loss: float, tokens: int, tokens_local: int, lr: Any = None, params: Any = None) -> None:
        self.tokens += int(tokens)
        self.marks.append({"step": int(step), "time": time.time(), "tokens": self.tokens})
        turns.after(step)

    def saved(self, count: int = 1) -> None:
        pass

    def finish(self, params: Any) -> None:
        turns.hand_on()


def bare_script(path: Path, run: str, out: Path) -> None:
    """``examples/ddp_train.py``'s ``main`` (via ``timed_script.py``) alone, given a ``BareSession``."""
    from harness.rank import script_session
    from harness.scenario import load_scenario
    from harness.scenario.plan import plan_scenario

    s = plan_scenario(load_scenario(path)).run(run).eff
    with tempfile.TemporaryDirectory() as d:
        bare = BareSession(s, Path(d))
        script_session.activate(bare)  # type: ignore[arg-type]
        timed_script.main()
    out.write_text(json.dumps(bare.marks))


BARE = {"mlx_lm": bare_mlx_lm, "script": bare_script, "mlx_vlm": bare_mlx_vlm, "unsloth_zoo": bare_unsloth_zoo}


def hide_as_its_rank_does(kind: str) -> None:
    """Mark absent in this bare process the packages the harness's rank of trainer ``kind`` hides
    before importing it (``TrainerInfo.hides``: torch for mlx-lm and mlx-vlm, which transformers
    would import where it is installed), so that both sides import the same libraries; on a GPU
    machine with torch its import set the bare side's start-up, and so a repeat's length."""
    from harness.rank.entry import hide
    from harness.scenario.trainers import trainer_info

    hide(trainer_info(kind).hides)


def bare_env() -> dict[str, str]:
    """The BLAS the harness's ranks run with (``launch.blas_preload``), one thread, as they have it."""
    from harness.controller.launch import blas_preload

    env = dict(os.environ)
    preload = blas_preload()
    if preload:
        env["LD_PRELOAD"] = os.pathsep.join(p for p in (preload, env.get("LD_PRELOAD")) if p)
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env
