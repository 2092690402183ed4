"""What the harness costs the trainer it measures: each trainer run bare, at its own defaults, and
under the harness, on the same model, rows, batch and process count, alternating in one invocation.

- **mlx-lm**: bare is ``mlx_lm.tuner.trainer.train`` called as a user calls it (its defaults:
  ``steps_per_report`` 10, no callback of the harness), on the model and rows the harness's
  mlx-lm adapter builds for the run (built with the harness's code before training starts, so
  that both train the same thing); under the harness it is the adapter, which reports every step.
- **script**: bare is ``examples/ddp_train.py``'s ``main`` in a process of its own, its session
  (``BareSession``) building the same model, rows and optimizer, its ``run.probe`` and
  ``run.finish`` doing nothing and ``run.step`` taking a timestamp; under the harness it is the
  script as shipped. Both sides run it through ``timed_script.py``, which times the session's
  calls: a second table splits each side's step into the script's own time and the time inside
  ``run.probe`` and ``run.step`` (under the harness, all the harness does in the script's step).
- **mlx-vlm**: bare is ``mlx_vlm.trainer.Trainer(model, VLMTrainingArgs(...), train_dataset=rows,
  optimizer=..., prepared=True, training_callback=..., seed=...).train()`` with its own SFT task and
  batch iterator and its defaults (``steps_per_report`` 10), on the qwen2_vl and prepared image rows
  the adapter builds (``load_image_rows``, its ``to_item``, ``build_model``); under the harness it
  is the adapter, which reports every step and wraps mlx-vlm's batch iterator to see each step
  (its last step is seen when ``train()`` returns, after mlx-vlm's final save: bare's last
  timestamp is taken there too).
  Tokens: mlx-vlm's own count of supervised tokens (``trained_tokens`` in its reports, the sum of
  the ``train_num_tokens`` the adapter's step events carry).
- **unsloth-zoo**: bare is ``unsloth_zoo.mlx.trainer.MLXTrainer(model, tokenizer, rows,
  args=MLXTrainingConfig(...)).train()`` on the model, pretokenized rows and config the adapter
  builds (``logging_steps`` 1, which is also its default), a timestamp taken by its own
  ``add_step_callback`` (no Hugging Face callback); under the harness it is the adapter, whose
  Hugging Face callback reports each logged step. Both import ``transformers.trainer_callback``
  before training (unsloth-zoo would at its last step). Tokens: its all-reduced supervised tokens
  (``trained_tokens``, the sum of what the adapter reports per step).

A vision-language trainer (mlx-vlm) gets a scenario of its own: a qwen2_vl of the text model's
size (``VLM_MODELS``) on generated captioned images, the other trainers the text model.

Both sides are timed alike, by the wall clock between the end of optimizer step ``--from`` and
the end of the last step, on rank 0 (bare: a timestamp taken where mlx-lm and mlx-vlm report,
every 10 steps, or at every step of the script and unsloth-zoo; under the harness: its ``step``
events' times), over the global supervised tokens trained in between. Each of ``--repeats`` rounds
runs both sides, bare first in even rounds and under the harness first in odd ones (whatever the
order costs falls on both sides alike); the table gives every repeat, the best of each side and
their ratio (harness / bare).

usage: python benchmarks/observer_effect.py [--model cpu3m|gpu044b]
                                            [--trainers mlx_lm,script,unsloth_zoo,mlx_vlm]
                                            [--steps N] [--from W] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import timed_script  # noqa: E402

# model config overrides (of the tiny qwen3), dtype, inputs per row, rows per step (one process)
MODELS: dict[str, tuple[dict[str, Any], str, int, int]] = {
    "cpu3m": ({"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64}, "float32", 256, 8),
    "gpu044b": ({"hidden_size": 1024, "num_hidden_layers": 28, "intermediate_size": 3072, "num_attention_heads": 16,
                 "num_key_value_heads": 8, "head_dim": 128}, "bfloat16", 1024, 8),
}
# each size as a qwen2_vl (mlx-vlm): the text model's language part and a small vision tower, as
# overrides of the harness's tiny qwen2_vl (harness.rank.vision); dtype, image side in pixels (a
# 28-pixel block is one image token), rows per step (one process)
VLM_MODELS: dict[str, tuple[dict[str, Any], str, int, int]] = {
    "cpu3m": ({"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768, "num_attention_heads": 4,
               "num_key_value_heads": 2, "rope_scaling": {"type": "mrope", "mrope_section": [16, 8, 8]},
               "vision_config": {"depth": 4, "embed_dim": 128, "hidden_size": 256, "num_heads": 4}},
              "float32", 112, 8),
    "gpu044b": ({"hidden_size": 1024, "num_hidden_layers": 28, "intermediate_size": 3072, "num_attention_heads": 16,
                 "num_key_value_heads": 8, "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
                 "vision_config": {"depth": 12, "embed_dim": 768, "hidden_size": 1024, "num_heads": 12}},
                "bfloat16", 448, 8),
}
TRAINERS = {"mlx_lm": 'trainer = { kind = "mlx_lm" }\n',
            "script": f'trainer = {{ kind = "script", path = "{REPO / "benchmarks" / "timed_script.py"}" }}\n',
            "unsloth_zoo": 'trainer = { kind = "unsloth_zoo" }\n',
            "mlx_vlm": 'trainer = { kind = "mlx_vlm" }\n'}
VISION = {"mlx_vlm"}  # trainers of a vision-language model: a scenario of their own (its [model] and [data])


def toml(v: Any) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(toml(x) for x in v) + "]"
    return json.dumps(v) if isinstance(v, str) else str(v)


def scenario_text(model: str, trainers: list[str], steps: int) -> str:
    """One scenario for ``trainers``, all text or all vision-language (``VISION``): the text model
    on generated text rows, or the qwen2_vl of the same size on generated captioned images."""
    if len({t in VISION for t in trainers}) > 1:
        raise ValueError("text and vision-language trainers need scenarios of their own")
    if trainers[0] in VISION:
        config, dtype, side, batch = VLM_MODELS[model]
        seq = (side // 28) ** 2 + 2 + 160  # its image block and a caption (up to ~130 bytes)
        arch, data = "qwen2_vl", (f'[data]\nsource = "images"\nrows = 64\nimage_size = {side}\n'
                                  f'max_seq_len = {seq}\n')
    else:
        config, dtype, seq, batch = MODELS[model]
        arch, data = "qwen3", (f'[data]\nsource = "generated"\nresponse_only = false\nrows = 64\n'
                               f'min_chars = {2 * seq}\nmax_chars = {2 * seq}\nmax_seq_len = {seq + 1}\n')
    runs = "".join(f'\n[[runs]]\nname = "{t}"\nworld_size = 1\n{TRAINERS[t]}' for t in trainers)
    return (f'[scenario]\nname = "observer_effect"\ndescription = "each trainer bare and under the harness"\n'
            f'seed = 5\nkind = "throughput"\n\n[model]\narch = "{arch}"\ndtype = "{dtype}"\n'
            f'config = {toml(config)}\n\n{data}\n[train]\nsteps = {steps}\nglobal_batch = {batch}\n'
            f'learning_rate = 1e-4\n{runs}\n[checks]\nreference = "{trainers[0]}"\n')


def report_clock(base: type, marks: list[dict[str, Any]]) -> Any:
    """A callback of ``base`` (mlx-lm's or mlx-vlm's ``TrainingCallback``) that takes one timestamp
    per loss report, with the trained tokens it reports, and does nothing else."""

    class Clock(base):  # type: ignore[misc, valid-type]
        def on_train_loss_report(self, info: dict[str, Any]) -> None:
            marks.append({"step": info["iteration"], "time": time.time(), "tokens": info["trained_tokens"]})

    return Clock()


def bare_mlx_lm(path: Path, run: str, out: Path) -> None:
    """mlx-lm's ``train`` as a user calls it, on the run's model and rows; the time of each of its
    reports (every 10 steps, and the last) to ``out``."""
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

    marks: list[dict[str, Any]] = []
    t = s.train
    with tempfile.TemporaryDirectory() as d:
        args = TrainingArgs(batch_size=t.global_batch, iters=t.steps, steps_per_eval=t.steps + 1,
                            steps_per_save=t.steps + 1, max_seq_length=s.data.max_seq_len,
                            adapter_file=str(Path(d) / "adapters.safetensors"))
        train(model, build_optimizer(t), train_set, None, args, training_callback=report_clock(TrainingCallback, marks))
    out.write_text(json.dumps(marks))


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

    with tempfile.TemporaryDirectory() as d:
        trainer = MLXTrainer(model, TokenizerView(rows.tokenizer, s.data.tokenizer), train_set,
                             args=training_config(s, 1, d))
        trainer.add_step_callback(clock)
        trainer.train()
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

    def saved(self, count: int = 1) -> None:
        pass

    def finish(self, params: Any) -> None:
        pass


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


def bare_env() -> dict[str, str]:
    """The BLAS the harness's ranks run with (``launch.blas_preload``), one thread, as they have it."""
    from harness.controller.launch import blas_preload

    env = dict(os.environ)
    preload = blas_preload()
    if preload:
        env["LD_PRELOAD"] = os.pathsep.join(p for p in (preload, env.get("LD_PRELOAD")) if p)
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


def window_rate(marks: list[dict[str, Any]], first: int) -> tuple[float, int, int]:
    """Global tokens per second from the mark at step ``first`` (or the first after it) to the last."""
    start = next(m for m in marks if m["step"] >= first)
    end = marks[-1]
    return (end["tokens"] - start["tokens"]) / (end["time"] - start["time"]), start["step"], end["step"]


def reported_rate(marks: list[dict[str, Any]], first: int) -> float:
    """What the harness itself reports over the same window: tokens over its steps' ``step_time_s``
    (the time between steps, less what its step-local probes took)."""
    later = [m for m in marks if m["step"] > first]
    return (later[-1]["tokens"] - marks[first - 1]["tokens"]) / sum(m["step_time_s"] for m in later)


def harnessed(path: Path, run: str) -> list[dict[str, Any]]:
    """The run under the harness: rank 0's step events as marks (cumulative global tokens)."""
    from harness.controller.run_job import execute
    from harness.scenario import load_scenario
    from harness.scenario.plan import job_for

    s = load_scenario(path)
    job = job_for(s, run)
    out = execute(f"observer_{run}", job, 1)
    if not out.ok:
        raise SystemExit(f"{run} under the harness: {out.failure}")
    marks, total = [], 0
    for e in out.ranks[0].events:
        if e.get("kind") == "step":
            total += int(e["tokens_global"])
            marks.append({"step": e["step"], "time": e["time"], "tokens": total, "step_time_s": e["step_time_s"]})
    return marks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="cpu3m")
    p.add_argument("--trainers", default=",".join(TRAINERS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--from", dest="first", type=int, default=10, help="the step the timed window starts after")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bare", nargs=3, metavar=("SCENARIO", "RUN", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.bare:
        path, run, out = Path(a.bare[0]), a.bare[1], Path(a.bare[2])
        BARE[run](path, run, out)
        return
    trainers = a.trainers.split(",")
    with tempfile.TemporaryDirectory() as d:
        (times := Path(d) / "times").mkdir()  # timed_script.py's rows (both sides' processes inherit the variable)
        os.environ[timed_script.TIMES_VAR] = str(times)
        split: dict[str, list[tuple[float, float]]] = {"bare": [], "harness": []}
        paths = {}  # each trainer's scenario: one for the text trainers, one for the vision-language ones
        for group in ([t for t in trainers if t not in VISION], [t for t in trainers if t in VISION]):
            if group:
                path = Path(d) / f"observer_effect_{'vlm' if group[0] in VISION else 'text'}.toml"
                path.write_text(scenario_text(a.model, group, a.steps))
                paths.update(dict.fromkeys(group, path))
        rates: dict[str, dict[str, list[float]]] = {t: {"bare": [], "harness": [], "reported": []} for t in trainers}
        for i in range(a.repeats):
            for t in trainers:
                for side in ("bare", "harness") if i % 2 == 0 else ("harness", "bare"):
                    if side == "bare":
                        marks = Path(d) / f"{t}.marks.json"
                        subprocess.run([sys.executable, __file__, "--bare", str(paths[t]), t, str(marks)], check=True,
                                       env=bare_env(), stdout=subprocess.DEVNULL)
                        rates[t]["bare"].append(window_rate(json.loads(marks.read_text()), a.first)[0])
                    else:
                        marks_h = harnessed(paths[t], t)
                        rates[t]["harness"].append(window_rate(marks_h, a.first)[0])
                        rates[t]["reported"].append(reported_rate(marks_h, a.first))
                    for f in sorted(times.glob(f"{side}-*.json")):  # the script's, just written
                        split[side].append(timed_script.split(json.loads(f.read_text()), a.first))
                        f.unlink()
    rows = []
    for t in trainers:
        bare, under = rates[t]["bare"], rates[t]["harness"]
        said = rates[t]["reported"]
        rows.append([t, ", ".join(f"{r:.0f}" for r in bare), ", ".join(f"{r:.0f}" for r in under),
                     f"{max(under) / max(bare):.3f}x",
                     ", ".join(f"{u / b:.3f}" for b, u in zip(bare, under, strict=True)),
                     ", ".join(f"{r:.0f}" for r in said), f"{max(said) / max(bare):.3f}x"])
    print(f"model {a.model}, 1 process, steps {a.steps}, timed after step {a.first}, {a.repeats} repeats "
          f"(both sides in turn, bare first in even repeats)")
    print(tabulate(rows, headers=["trainer", "bare tok/s", "under the harness tok/s", "best / best",
                                  "per repeat", "the harness's own figure tok/s", "its best / bare best"]))
    if split["harness"]:
        print("\nthe script's step, ms per step over the same window, per repeat: its own time / inside run.probe "
              "and run.step")
        print(tabulate([[side, ", ".join(f"{own * 1e3:.1f}" for own, _ in split[side]),
                         ", ".join(f"{calls * 1e3:.3f}" for _, calls in split[side])] for side in ("bare", "harness")],
                       headers=["side", "the script's own", "inside the session's calls"]))


if __name__ == "__main__":
    main()
