"""What the harness costs the trainer it measures: each trainer run bare, at its own defaults, and
under the harness, on the same model, rows, batch and process count, alternating in one invocation.

- **mlx-lm**: bare is ``mlx_lm.tuner.trainer.train`` called as a user calls it (its defaults:
  ``steps_per_report`` 10, no callback of the harness), on the model and rows the harness's
  mlx-lm adapter builds for the run (built with the harness's code before training starts, so
  that both train the same thing); under the harness it is the adapter, which reports every step.
- **script**: bare is ``examples/ddp_train.py``'s ``main`` in a process of its own, its session
  (``BareSession``) building the same model, rows and optimizer, its ``run.probe`` and
  ``run.finish`` doing nothing and ``run.step`` taking a timestamp; under the harness it is the
  script as shipped.

Both sides are timed alike, by the wall clock between the end of optimizer step ``--from`` and
the end of the last step, on rank 0 (bare: a timestamp taken where mlx-lm reports, every 10
steps, or at every step of the script; under the harness: its ``step`` events' times), over the
global supervised tokens trained in between. Each of ``--repeats`` rounds runs bare then under the
harness; the table gives every repeat, the best of each side and their ratio (harness / bare).

usage: python benchmarks/observer_effect.py [--model cpu3m|gpu044b] [--trainers mlx_lm,script]
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

# model config overrides (of the tiny qwen3), dtype, inputs per row, rows per step (one process)
MODELS: dict[str, tuple[dict[str, Any], str, int, int]] = {
    "cpu3m": ({"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64}, "float32", 256, 8),
    "gpu044b": ({"hidden_size": 1024, "num_hidden_layers": 28, "intermediate_size": 3072, "num_attention_heads": 16,
                 "num_key_value_heads": 8, "head_dim": 128}, "bfloat16", 1024, 8),
}
TRAINERS = {"mlx_lm": 'trainer = { kind = "mlx_lm" }\n',
            "script": f'trainer = {{ kind = "script", path = "{REPO / "examples" / "ddp_train.py"}" }}\n'}


def scenario_text(model: str, trainers: list[str], steps: int) -> str:
    config, dtype, seq, batch = MODELS[model]
    cfg = ", ".join(f"{k} = {v}" for k, v in config.items())
    runs = "".join(f'\n[[runs]]\nname = "{t}"\nworld_size = 1\n{TRAINERS[t]}' for t in trainers)
    return (f'[scenario]\nname = "observer_effect"\ndescription = "each trainer bare and under the harness"\n'
            f'seed = 5\nkind = "throughput"\n\n[model]\narch = "qwen3"\ndtype = "{dtype}"\nconfig = {{ {cfg} }}\n\n'
            f'[data]\nsource = "generated"\nresponse_only = false\nrows = 64\nmin_chars = {2 * seq}\n'
            f'max_chars = {2 * seq}\nmax_seq_len = {seq + 1}\n\n[train]\nsteps = {steps}\nglobal_batch = {batch}\n'
            f'learning_rate = 1e-4\n{runs}\n[checks]\nreference = "{trainers[0]}"\n')


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

    class Clock(TrainingCallback):  # one timestamp per mlx-lm report: nothing else
        def on_train_loss_report(self, info: dict[str, Any]) -> None:
            marks.append({"step": info["iteration"], "time": time.time(), "tokens": info["trained_tokens"]})

    t = s.train
    with tempfile.TemporaryDirectory() as d:
        args = TrainingArgs(batch_size=t.global_batch, iters=t.steps, steps_per_eval=t.steps + 1,
                            steps_per_save=t.steps + 1, max_seq_length=s.data.max_seq_len,
                            adapter_file=str(Path(d) / "adapters.safetensors"))
        train(model, build_optimizer(t), train_set, None, args, training_callback=Clock())
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
    """``examples/ddp_train.py``'s ``main`` in a process of its own, given a ``BareSession``."""
    import importlib.util

    from harness.rank import script_session
    from harness.scenario import load_scenario
    from harness.scenario.plan import plan_scenario

    s = plan_scenario(load_scenario(path)).run(run).eff
    spec = importlib.util.spec_from_file_location("ddp_train", REPO / "examples" / "ddp_train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with tempfile.TemporaryDirectory() as d:
        bare = BareSession(s, Path(d))
        script_session.activate(bare)  # type: ignore[arg-type]
        script.main()
    out.write_text(json.dumps(bare.marks))


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
    p.add_argument("--trainers", default="mlx_lm,script")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--from", dest="first", type=int, default=10, help="the step the timed window starts after")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bare", nargs=3, metavar=("SCENARIO", "RUN", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.bare:
        path, run, out = Path(a.bare[0]), a.bare[1], Path(a.bare[2])
        (bare_mlx_lm if run == "mlx_lm" else bare_script)(path, run, out)
        return
    trainers = a.trainers.split(",")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "observer_effect.toml"
        path.write_text(scenario_text(a.model, trainers, a.steps))
        rates: dict[str, dict[str, list[float]]] = {t: {"bare": [], "harness": [], "reported": []} for t in trainers}
        for _ in range(a.repeats):
            for t in trainers:
                marks = Path(d) / f"{t}.marks.json"
                subprocess.run([sys.executable, __file__, "--bare", str(path), t, str(marks)], check=True,
                               env=bare_env(), stdout=subprocess.DEVNULL)
                rates[t]["bare"].append(window_rate(json.loads(marks.read_text()), a.first)[0])
                marks_h = harnessed(path, t)
                rates[t]["harness"].append(window_rate(marks_h, a.first)[0])
                rates[t]["reported"].append(reported_rate(marks_h, a.first))
    rows = []
    for t in trainers:
        bare, under = rates[t]["bare"], rates[t]["harness"]
        said = rates[t]["reported"]
        rows.append([t, ", ".join(f"{r:.0f}" for r in bare), ", ".join(f"{r:.0f}" for r in under),
                     f"{max(under) / max(bare):.3f}x",
                     ", ".join(f"{u / b:.3f}" for b, u in zip(bare, under, strict=True)),
                     ", ".join(f"{r:.0f}" for r in said), f"{max(said) / max(bare):.3f}x"])
    print(f"model {a.model}, 1 process, steps {a.steps}, timed after step {a.first}, {a.repeats} repeats "
          f"(bare then under the harness, in turn)")
    print(tabulate(rows, headers=["trainer", "bare tok/s", "under the harness tok/s", "best / best",
                                  "per repeat", "the harness's own figure tok/s", "its best / bare best"]))


if __name__ == "__main__":
    main()
