"""The reference trainer's speed beside mlx-lm's own trainer and mlx-lm's bare step, on the same
model, dtype, per-rank batch and world size, in one invocation.

For each world size and compile mode it runs, all launched by the harness on one throughput
scenario (generated rows longer than ``max_seq_len`` = inputs + 1 tokens, truncated to it,
every token a target):
- the harness's reference trainer;
- the anchor, mlx-lm's real trainer: the harness's mlx-lm adapter (``trainer = { kind = "mlx_lm" }``
  on a run of its own), which calls ``mlx_lm.tuner.trainer.train`` with its ``iterate_batches``,
  its compiled step and its all-reduce, on the same rows; ``max_seq_length`` = ``max_seq_len``
  clamps its padded width, so it trains the same inputs per row;
- mlx-lm's step alone (``harness.rank.anchor``: ``default_loss``, ``nn.average_gradients`` and the
  update in a plain loop, compiled together when compiling, on the same rows, tokenized before
  the timed steps; on a CUDA GPU a step's time depends on the tokens it trains).
mlx-lm's ``train`` always compiles its step: the eager rows launch every rank of all three with
``MLX_DISABLE_COMPILE=1`` (nothing compiles, mlx-lm's activations included), which the step loop's
rank confirms. It prints post-step-1 median tok/s, the ratio reference / mlx-lm trainer, the
scaling over the first world size, the model FLOPs utilization where the device's peak is known
(``PEAKS``: the vendors' dense bf16/fp16 tensor-core figures; none for CPUs), and the padded input
width each trained at (its ``input_widths``, per optimizer step: min-max, ``?`` when unreported).
``--without-trainer`` leaves mlx-lm's trainer out (its columns ``-``): the reference against the
bare step alone, in two of a repeat's three runs.

Each run alternates the three ``--repeats`` times (each of them first in turn) and keeps each
one's best post-step-1 median, so that a slow phase of a shared machine does not decide the
ratio; every figure says which repeat was kept and the range over repeats (``77780 (r2/3:
75100-77780)``), and a scaling is the kept figures' ratio with the range of the repeat-by-repeat
ratios (repeat r at N ranks over repeat r at the first world size; where ``--max-repeats`` gave
one more repeats, its first ones). For every world size above the first (and without
``--time-limit`` or ``--report-only``), a second table puts the gradient all-reduce alone (``nn.average_gradients`` on a
gradient of the model's shapes, ``harness.rank.anchor.allreduce``) beside what the harness's
eager step takes over the first world size's at the same per-rank batch. A third gives, per run,
the reference's tok/s over the bare step's repeat by repeat, their mean with its 95 % interval
(``repeat_ratios``) and whether it tells a 2 % gap from none; ``--max-repeats`` adds repeats
until it does. ``--record FILE`` keeps each repeat in FILE as it finishes and continues the
repeats already there (``repeat_record``): a run's repeats carried over several invocations.
``--turns K --from F`` (with ``--without-trainer``) runs a repeat's reference and bare step at
once, each in a process of its own, taking turns K steps at a time after step F
(``taking_turns``, ``harness.rank.turns``: rank 0 of each waits for its turn between steps,
outside their times), and takes each one's median over the steps after F: a machine whose speed
wanders between two runs wanders under both alike.

usage: python benchmarks/step_vs_mlx_lm.py [--model tiny|cpu3m|gpu044b|host28] [--world-sizes 1,2]
                                           [--modes eager,compiled] [--steps N] [--repeats R]
                                           [--max-repeats M] [--backend ring|nccl]
                                           [--without-trainer [--turns K --from F]]
                                           [--look-every K] [--record FILE [--time-limit S | --report-only]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from repeat_ratios import RESOLVED, Ratios, ended, look_level, looks, split_spread, what_it_takes  # noqa: E402
from repeat_record import RepeatRecord, add_options, check_options, planned_device, quiet_pipe, time_limit  # noqa: E402
from taking_turns import run_at_once, timeline_line, unwind_on_sigterm  # noqa: E402

from harness.controller.run_job import execute  # noqa: E402
from harness.rank import turns
from harness.scenario import load_scenario
from harness.scenario.job import AnchorJob
from harness.scenario.plan import job_for

# model config overrides (of the tiny qwen3), dtype, inputs per row (a multiple of 32), per-rank batch
MODELS: dict[str, tuple[dict[str, Any], str, int, int]] = {
    "tiny": ({}, "float32", 160, 8),  # steps of a few ms: time 40 of them (--steps), the median is steadier
    "cpu3m": ({"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64}, "float32", 256, 8),
    "gpu044b": ({"hidden_size": 1024, "num_hidden_layers": 28, "intermediate_size": 3072, "num_attention_heads": 16,
                 "num_key_value_heads": 8, "head_dim": 128}, "bfloat16", 1024, 8),
    # gpu044b's 28 layers, narrow and short: a step whose host work (building the graph, which
    # grows with the layers, not the width) is a large share, measurable on a CPU
    "host28": ({"hidden_size": 256, "num_hidden_layers": 28, "intermediate_size": 768, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 64}, "bfloat16", 32, 2),
}
# Dense bf16/fp16 tensor-core peak FLOP/s by device name (NVIDIA's data sheets, SXM parts).
PEAKS = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12}
MODES = {"eager": "off", "compiled": "best_effort"}
MLX_LM = "_mlx_lm"  # the name suffix of a run of mlx-lm's trainer


def scenario_text(model: str, world_sizes: list[int], steps: int) -> str:
    """Per world size and mode, a reference run ``ws{n}_{mode}`` and an mlx-lm run beside it
    (``ws{n}_{mode}_mlx_lm``). Rows of 2 x seq characters, truncated to ``max_seq_len`` = seq + 1
    tokens: seq inputs per row, which mlx-lm's padded width (clamped to it) also is."""
    config, dtype, seq, per_rank = MODELS[model]
    cfg = ", ".join(f"{k} = {v}" for k, v in config.items())
    runs = "".join(f'\n[[runs]]\nname = "ws{n}_{c}{suffix}"\nworld_size = {n}\n{trainer}'
                   f'train = {{ global_batch = {per_rank * n}, compile = "{MODES[c]}" }}\n'
                   for n in world_sizes for c in MODES
                   for suffix, trainer in (("", ""), (MLX_LM, 'trainer = { kind = "mlx_lm" }\n')))
    return (f'[scenario]\nname = "step_vs_mlx_lm"\ndescription = "reference trainer vs mlx-lm trainer and step"\n'
            f'seed = 5\nkind = "throughput"\n\n[model]\narch = "qwen3"\ndtype = "{dtype}"\nconfig = {{ {cfg} }}\n\n'
            f'[data]\nsource = "generated"\nresponse_only = false\nrows = 64\nmin_chars = {2 * seq}\n'
            f'max_chars = {2 * seq}\nmax_seq_len = {seq + 1}\n\n[train]\nsteps = {steps}\nglobal_batch = {per_rank}\n'
            f'learning_rate = 1e-4\n{runs}\n[checks]\nreference = "ws{world_sizes[0]}_eager"\n')


def post_step1_median(result: dict[str, Any], first: int = 1) -> float:
    """The median tok/s of the steps after step ``first`` (1, or taking turns, ``--from``)."""
    values = result["tok_s_global"]
    return statistics.median(values[first:] if len(values) > first else values)


def widths(result: dict[str, Any]) -> str:
    """A run's padded input widths: ``1024``, or ``96-160`` when its steps differ; ``?`` if unreported."""
    found = [w for w in result.get("input_widths") or [] if w is not None]
    if not found:
        return "?"
    return str(found[0]) if min(found) == max(found) else f"{min(found)}-{max(found)}"


def flops_per_token(params: int, config: dict[str, Any], seq: int) -> float:
    """6 N per trained token, plus the attention scores and values (12 x layers x seq x width)."""
    width = config["num_attention_heads"] * config["head_dim"]
    return 6 * params + 12 * config["num_hidden_layers"] * seq * width


@contextmanager
def compile_disabled(disabled: bool) -> Iterator[None]:
    """Ranks launched inside see ``MLX_DISABLE_COMPILE=1`` when ``disabled`` (they inherit the
    launcher's environment); the variable is as it was afterwards."""
    before = os.environ.get("MLX_DISABLE_COMPILE")
    if disabled:
        os.environ["MLX_DISABLE_COMPILE"] = "1"
    try:
        yield
    finally:
        if disabled and before is None:
            del os.environ["MLX_DISABLE_COMPILE"]
        elif disabled:
            os.environ["MLX_DISABLE_COMPILE"] = before


def launch(spec: Any, job: dict[str, Any], backend: str | None, first: int = 1) -> dict[str, Any]:
    """Rank 0's result of ``job`` on ``spec``'s world size, with its phases' medians over the steps
    after step ``first``; a failed run ends the benchmark."""
    out = execute(f"{spec.name}_{job.kind}", job, spec.world_size, backend=backend or spec.backend)
    if not out.ok:
        raise SystemExit(f"{spec.name} ({job.kind}): {out.failure}")
    steps = [e for e in out.ranks[0].events if e.get("kind") == "step"][first:]
    phases = {k: statistics.median(e[k] for e in steps) for k in PHASES + ("step_time_s",)
              if steps and all(k in e for e in steps)}
    return {**out.result(0), "phase_medians_s": phases}


PHASES = ("fetch_s", "build_s", "eval_s")


def phase_row(spec: Any, mode: str, who: str, result: dict[str, Any]) -> list[Any] | None:
    """Rank 0's median post-step-1 milliseconds fetching, building and evaluating a step, where
    the trainer times them (the reference and the step loop; mlx-lm's trainer does not)."""
    med = result.get("phase_medians_s") or {}
    if not all(k in med for k in PHASES + ("step_time_s",)):
        return None
    return [spec.world_size, mode, who, *(f"{med[k] * 1e3:.1f}" for k in PHASES + ("step_time_s",))]


def measure(spec: Any, job: dict[str, Any], backend: str | None) -> tuple[float, dict[str, Any]]:
    result = launch(spec, job, backend)
    return post_step1_median(result), result


SIDES = ("harness", "step")  # taking turns: the reference trainer and the bare step, each in a process of its own


def run_side(s: Any, args: argparse.Namespace) -> None:
    """``--one-side SIDE RUN OUT``: one side of run RUN's repeat, taking turns (``harness.rank.turns``
    in the environment), its rank 0 result written to OUT."""
    side, name, out = args.one_side
    unwind_on_sigterm()
    spec = s.run(name)
    job = job_for(s, name) if side == "harness" else AnchorJob(s.for_run(spec))
    with compile_disabled(name.split("_")[1] == "eager"):
        Path(out).write_text(json.dumps(launch(spec, job, args.backend, args.first)))


def both_at_once(spec: Any, args: argparse.Namespace, k: int
                 ) -> tuple[list[tuple[float, dict[str, Any]] | None], dict[str, float], dict[str, Any]]:
    """Repeat ``k`` of run ``spec``: the reference and the bare step at once, taking turns
    ``--turns`` steps at a time from step ``--from`` (each first in turn); each one's median tok/s
    after step ``--from`` and its result, in the order of ``bare_ratio``'s three, the seconds
    each waited for its turns, and the repeat's timeline (``run_at_once``'s)."""
    order = list(SIDES[k % 2:] + SIDES[:k % 2])
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        base = [sys.executable, str(Path(__file__).resolve()), "--model", args.model, "--world-sizes",
                args.world_sizes, "--steps", str(args.steps), "--without-trainer", "--turns", str(args.turns),
                "--from", str(args.first),
                *(["--backend", args.backend] if args.backend else [])]
        timeline = run_at_once({side: ([*base, "--one-side", side, spec.name, str(d / side)], dict(os.environ))
                                for side in order}, d, args.first, args.turns, args.steps, spec.name)
        got = {side: json.loads((d / side).read_text()) for side in order}
        waited = {side: sum(b - a for a, b in turns.waits(d / f"waits-{side}")) for side in order}
    return [(post_step1_median(got[side], args.first), got[side]) if side else None
            for side in ("harness", None, "step")], waited, timeline


def turns_allowed(args: argparse.Namespace) -> None:
    """``--turns K``: the reference against the bare step alone, from a step before the last."""
    if args.turns is None:
        if args.first is not None:
            raise SystemExit("--from: the step the turns start after, with --turns")
        return
    if args.turns < 1 or not args.without_trainer or not 1 <= (args.first or 0) < args.steps:
        raise SystemExit(f"--turns {args.turns}: K of at least 1, with --without-trainer (the reference and the bare "
                         f"step take turns) and --from F of 1 to --steps - 1 (got --from {args.first}, --steps "
                         f"{args.steps})")


def kept(values: list[float]) -> int:
    """The index of the repeat whose figure is kept: the fastest."""
    return max(range(len(values)), key=values.__getitem__)


def figure(values: list[float], form: str = ".0f", suffix: str = "") -> str:
    """The kept (best) of ``values``, with which repeat it was and the range over repeats."""
    if len(values) == 1:
        return f"{values[0]:{form}}{suffix}"
    k = kept(values)
    return (f"{values[k]:{form}}{suffix} (r{k + 1}/{len(values)}: "
            f"{min(values):{form}}-{max(values):{form}}{suffix})")


def ratio_figure(mine: list[float], base: list[float]) -> str:
    """``mine`` over ``base``: the kept figures' ratio, and the range of the repeat-by-repeat ratios."""
    best = max(mine) / max(base)
    if len(mine) == 1:
        return f"{best:.2f}x"
    pairs = [a / b for a, b in zip(mine, base, strict=False)]  # a run given more repeats: its first ones
    return f"{best:.2f}x ({min(pairs):.2f}-{max(pairs):.2f}x)"


def bare_ratio(got: list[list[tuple[float, dict[str, Any]]]], level: float) -> Ratios:
    """The reference trainer's tok/s over mlx-lm's bare step's, repeat by repeat."""
    return Ratios(tuple(h / b for (h, _), (b, _) in zip(got[0], got[2], strict=True)), level)


def window_halves(got: list[list[tuple[float, dict[str, Any]]]], first: int) -> tuple[list[float], list[float]] | None:
    """Each repeat's reference-over-bare-step ratio of median tok/s in the two halves of its steps
    after ``first`` (``repeat_ratios.split_spread``); None under 3 repeats or 4 steps a half."""
    a, b = [], []
    for (_, mine), (_, bare) in zip(got[0], got[2], strict=True):
        x, y = mine["tok_s_global"][first:], bare["tok_s_global"][first:]
        m = min(len(x), len(y)) // 2
        if m < 4:
            return None
        a.append(statistics.median(x[:m]) / statistics.median(y[:m]))
        b.append(statistics.median(x[m:2 * m]) / statistics.median(y[m:2 * m]))
    return (a, b) if len(a) >= 3 else None


def window_seconds(got: list[list[tuple[float, dict[str, Any]]]], first: int) -> float:
    """The median seconds of a repeat's steps after ``first``, every run's of it together (taking
    turns, the window's length)."""
    return statistics.median(sum(sum(result["step_times_s"][first:]) for _, result in runs)
                             for runs in zip(*(g for g in got if g), strict=True))


def finished(got: list[list[tuple[float, dict[str, Any]]]], points: list[int], level: float) -> bool:
    """Whether a run's repeats so far end it: at a look where its interval is resolved, or at the last."""
    return ended(len(got[0]), points, lambda: bare_ratio(got, level).resolved())


def allreduce_rows(s: Any, steps: dict[tuple[int, str], float], backend: str | None) -> list[list[Any]]:
    """Per world size above one: the gradient all-reduce alone (``grad_allreduce``) beside what
    the harness's step (eager where it ran) gains over one rank at the same per-rank batch."""
    rows, first = [], min(n for n, _ in steps)
    mode = "eager" if any(m == "eager" for _, m in steps) else "compiled"
    for spec in s.runs:
        if spec.world_size == first or not spec.name.endswith(f"_{mode}"):
            continue
        ar = launch(spec, AnchorJob(s.for_run(spec), 10, "grad_allreduce"), backend)
        step_n, step_1 = steps[(spec.world_size, mode)], steps[(first, mode)]
        rows.append([spec.world_size, mode, f"{ar['bytes'] / 2**20:.1f}", f"{ar['allreduce_s'] * 1e3:.2f}",
                     f"{step_1 * 1e3:.2f}", f"{step_n * 1e3:.2f}", f"{(step_n - step_1) * 1e3:.2f}",
                     f"{ar['allreduce_s'] / step_n:.1%}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--modes", default="eager,compiled", help="which of eager, compiled to run")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: 40 for tiny, else 12)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="alternate the three this many times per run and keep each one's best median")
    ap.add_argument("--max-repeats", type=int, default=None,
                    help="add alternating repeats until the harness / step ratio's interval tells a 2%% effect from "
                         "none, up to this many (default: --repeats)")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--without-trainer", action="store_true",
                    help="leave mlx-lm's trainer out: the reference against the bare step alone")
    ap.add_argument("--turns", type=int, metavar="K", help="with --without-trainer: the reference and the bare step "
                    "at once, taking turns K steps at a time from step --from, each timed over the steps after it")
    ap.add_argument("--from", dest="first", type=int, metavar="F", help="with --turns: the step the turns start after")
    ap.add_argument("--one-side", nargs=3, metavar=("SIDE", "RUN", "OUT"), help=argparse.SUPPRESS)
    add_options(ap)
    args = ap.parse_args()
    sizes = [int(n) for n in args.world_sizes.split(",")]
    check_options(args)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"--modes: each of {', '.join(MODES)}, got {args.modes!r}")
    args.steps = args.steps or (40 if args.model == "tiny" else 12)
    turns_allowed(args)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "step_vs_mlx_lm.toml"
        path.write_text(scenario_text(args.model, sizes, args.steps))
        s = load_scenario(path)
    if args.one_side:
        run_side(s, args)
        return
    _, dtype, seq, per_rank = MODELS[args.model]
    rows, base, step_s, phase_rows, step_rows, step_notes = [], {}, {}, [], [], []
    # its three runs rotate within a repeat
    points = looks(args.repeats, args.max_repeats or args.repeats, 1, args.look_every)
    level = look_level(len(points))
    plan = {"device": planned_device(args), "--model": args.model, "--world-sizes": sizes, "--modes": modes,
            "--steps": args.steps, "--backend": args.backend,
            **({"--without-trainer": True} if args.without_trainer else {}),
            **({"--turns": args.turns, "--from": args.first} if args.turns else {}),
            "--repeats/--max-repeats (looks after)": points}
    record = RepeatRecord.open(args.record, "step_vs_mlx_lm", plan, report_only=args.report_only)
    if record.repeats:
        doing = "reporting" if args.report_only else "continuing"
        print(f"{doing} {args.record}: {record.provenance()}", file=sys.stderr, flush=True)
    name = record.plan["device"]  # this machine's (``cuda: NVIDIA H200``), or where reported only, the record's
    peak = PEAKS.get(name.partition(": ")[2] or name)
    mfu_ok = peak is not None and dtype in ("bfloat16", "float16")
    limit, stopped = time_limit(args), False
    for spec in s.runs:
        mode = spec.name.split("_")[1]
        if spec.name.endswith(MLX_LM) or mode not in modes:
            continue
        theirs = s.run(spec.name + MLX_LM)
        runs = ((spec, job_for(s, spec.name)), (theirs, job_for(s, theirs.name)),
                (spec, AnchorJob(s.for_run(spec))))
        got: list[list[tuple[float, dict[str, Any]]]] = [[], [], []]
        which = [0, 2] if args.without_trainer else [0, 1, 2]  # the harness, mlx-lm's trainer, the bare step
        for kept_repeat in (r["got"] for r in record.data() if r["run"] == spec.name):  # earlier invocations'
            for i in which:
                got[i].append(tuple(kept_repeat[i]))
        while not finished(got, points, level) and not stopped:  # alternating, each first in turn
            if not limit.room():
                stopped = True
                limit.stopped(record, len(got[0]), points[-1])
                break
            k, repeat, waited, timeline = len(got[0]), [None, None, None], None, None
            if args.turns:
                repeat, waited, timeline = both_at_once(spec, args, k)
            else:
                for i in which[k % len(which):] + which[:k % len(which)]:  # each first in turn
                    with compile_disabled(mode == "eager"):
                        repeat[i] = measure(runs[i][0], runs[i][1], args.backend)
            for i in which:
                got[i].append(repeat[i])
            record.add({"run": spec.name, "got": repeat, **({"waited_s": waited} if waited else {}),
                        **({"timeline": timeline} if timeline else {})})
        if not got[0]:
            continue
        tok_s = [[v for v, _ in g] for g in got]  # mlx-lm's trainer's empty where left out
        against_step = bare_ratio(got, level)
        at_look = len(got[0]) in points
        step_rows.append([spec.world_size, mode, ", ".join(f"{v:.3f}" for v in against_step.values),
                          against_step.cell(), against_step.verdict() if at_look
                          else f"none before a look ({', '.join(map(str, points))})"])
        halves = window_halves(got, args.first or 1)
        spread = split_spread(*halves) if halves else None
        each = record.seconds_per_repeat(lambda d, run=spec.name: d["run"] == run)
        takes = at_look and what_it_takes(against_step, points, 1, each, spread, window_seconds(got, args.first or 1))
        timelines = [r["timeline"] for r in record.data() if r["run"] == spec.name and "timeline" in r]
        step_notes += [f"{spec.world_size} {mode}, {label}: {text}" for label, text in
                       (("within a run (the halves of each repeat's steps)", spread and spread.line()),
                        ("to resolve at this mean and spread", takes),
                        ("taking turns", timelines and timeline_line(timelines))) if text]
        ours, trainer, loop = (g[kept(t)][1] if g else None for g, t in zip(got, tok_s, strict=True))
        if loop["mlx_compile"] != (mode == "compiled"):
            raise SystemExit(f"{spec.name}: MLX compiles {'' if loop['mlx_compile'] else 'not '}in the ranks")
        phase_rows += [r for r in (phase_row(spec, mode, "harness", ours), phase_row(spec, mode, "step", loop)) if r]
        has = [bool(t) for t in tok_s]
        params = ours["param_count"]
        base.setdefault(mode, tok_s)
        best = [max(t) if t else 0.0 for t in tok_s]
        step_s[(spec.world_size, mode)] = ours["tokens_global_per_step"][0] / best[0]
        per_token = flops_per_token(params, ours["model_config"], seq)  # the config the model was built from
        mfu = [f"{v * per_token / (peak * spec.world_size):.1%}" if mfu_ok and v else "-" for v in best[:2]]
        scaling = "/".join(ratio_figure(v, b) if h else "-" for v, b, h in zip(tok_s, base[mode], has, strict=True))
        rows.append([spec.world_size, mode, *(figure(t) if h else "-" for t, h in zip(tok_s, has, strict=True)),
                     ratio_figure(tok_s[0], tok_s[1]) if has[1] else "-",
                     scaling if spec.world_size != sizes[0] else "/".join("1.00x" if h else "-" for h in has), *mfu,
                     *(widths(r) if r else "-" for r in (ours, trainer, loop))])
        print("done:", " | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)  # kept if a later run fails
    if args.record:
        print(f"record {args.record}: {record.provenance()}")
    print(f"{args.model}: qwen3 {params / 1e6:.2f}M, {dtype}, {per_rank} x {seq} inputs per rank, {args.steps} steps, "
          f"the best of each run's repeats, on {name} (peak: {'%.0f TFLOP/s' % (peak / 1e12) if peak else 'unknown'})")
    print(tabulate(rows, headers=["World size", "Mode", "Harness tok/s", "mlx-lm trainer tok/s", "mlx-lm step tok/s",
                                  "Harness / trainer", f"Scaling vs {sizes[0]} (harness/trainer/step)",
                                  "MFU harness", "MFU trainer", "Width harness", "Width trainer", "Width step"]))
    print("trainer: mlx_lm.tuner.trainer.train (the anchor); step: its step in a plain loop. eager: every rank run "
          "with MLX_DISABLE_COMPILE=1 (mlx-lm's train() compiles its step otherwise). Width: padded inputs per row.")
    if args.repeats > 1:
        print("Each figure: the fastest repeat (rK/R: which), then the range over repeats. Ratios and scaling: the "
              "kept figures' ratio, then the range of the repeat-by-repeat ratios.")
    print()
    print(tabulate(step_rows, headers=["World size", "Mode", "Harness / step, per repeat", "Mean [95% interval]",
                                       "Verdict"]))
    print(f"The reference trainer over mlx-lm's bare step, repeat by repeat (Student's t interval of the mean at "
          f"{level:.4g} a look, 95% over {len(points)} looks; resolved: {RESOLVED}, repeats added up to "
          f"--max-repeats until it is).")
    print("\n".join(step_notes))
    if phase_rows:
        print()
        print(tabulate(phase_rows, headers=["World size", "Mode", "Who", "Fetch ms", "Build ms", "Eval ms",
                                            "Step ms"]))
        print(f"Rank 0, median after step {args.first or 1} of the best repeat. Fetch: batch and token-count "
              "agreement; build: the lazy graph; eval: mx.eval of the step.")
    reduce_rows = [] if args.time_limit is not None or args.report_only else allreduce_rows(s, step_s, args.backend)
    if reduce_rows:
        print()
        print(tabulate(reduce_rows, headers=["World size", "Mode", "Gradient MiB", "all-reduce ms (alone)",
                                             f"Harness step ms at {sizes[0]}", "Harness step ms", "Extra ms",
                                             "All-reduce share of step"]))


if __name__ == "__main__":
    quiet_pipe(main)
