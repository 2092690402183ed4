"""What the harness costs the trainer it measures: each trainer run bare, at its own defaults, and
under the harness, on the same model, rows, batch and process count, alternating in one invocation.

- **mlx-lm**: bare is ``mlx_lm.tuner.trainer.train`` called as a user calls it (its defaults:
  ``steps_per_report`` 10, no callback of the harness), on the model and rows the harness's
  mlx-lm adapter builds for the run (built with the harness's code before training starts, so
  that both train the same thing), timed at every step where its loop asks for the next batch
  (``bare_trainers.FetchClock``); under the harness it is the adapter, which reports every step.
- **script**: bare is ``examples/ddp_train.py``'s ``main`` in a process of its own, its session
  (``BareSession``) building the same model, rows and optimizer, its ``run.probe`` and
  ``run.finish`` doing nothing and ``run.step`` taking a timestamp; under the harness it is the
  script as shipped. Both sides run it through ``timed_script.py``, which times the session's
  calls: a second table splits each side's step into the script's own time and the time inside
  ``run.probe`` and ``run.step`` (under the harness, all the harness does in the script's step),
  and gives the time in the garbage collector, its full collections, the objects it tracks and
  the median of the script's own time a step (a cost in every step moves it, one in a few does not).
  Where ``nvidia-smi`` answers, the same window's GPU SM clock, power and temperature are added
  (``gpu_clocks.py``): whether a slower run was a slower GPU.
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
size (``VLM_MODELS``) on generated captioned images, the other trainers the text model. Every bare
side marks absent what its trainer's rank hides (``bare_trainers.hide_as_its_rank_does``: torch
for mlx-lm and mlx-vlm), so that both sides import the same libraries.

Both sides are timed alike, by the wall clock between the end of optimizer step ``--from`` and the
end of the last step, on rank 0 (bare: a timestamp taken where mlx-vlm reports, every 10 steps,
where mlx-lm asks for each next batch, and at each step of the script and unsloth-zoo; under the
harness: its ``step`` events' times), over the global supervised tokens trained in between. Each
repeat runs every side once per trainer, each side first in turn (bare first in even repeats where
there are two), so whatever the order costs falls on every side alike. The figure judged is the
mean of the per-repeat ratios (harness / bare) with its interval (``repeat_ratios``: 95 % over the
looks): after ``--repeats`` repeats, more are added a rotation of the sides at a time until every
interval lies on one side of a 2 % cost, up to ``--max-repeats`` (both rounded up to whole
rotations, so every side goes first equally often); each ratio's verdict says whether it could.
``--record FILE`` keeps each repeat in FILE as it finishes and continues the repeats already there
(``repeat_record``): one comparison carried over several invocations, judged over all of them.

``--ablate PARTS`` adds a third side: the harness with those parts of what it does to a rank turned
off (``harness.ablation``; ``all`` for every one), and two more ratios: that side over bare, and the
harness over it (what the parts cost; below 1 they slow the trainer). Screen with ``all``, then
halve the set. ``--sides harness,ablated`` runs those two alone (the parts' effect, without the bare
side). ``--sides ...,bare_every_step`` (mlx-lm alone) adds mlx-lm bare reporting every step, as its
adapter under the harness has it report (``steps_per_report`` of one optimizer step, against its
default 10): ``harness / bare_every_step`` is then what the harness costs apart from that reporting,
and ``bare_every_step / bare`` what the reporting costs mlx-lm by itself. ``--node N`` runs this
process and every one it starts on NUMA node N's CPUs (their affinity, inherited): where the
script's split shows the sides' steps on different nodes, this tells what placement costs from what
the harness does. ``--turns K`` (the script, mlx-lm or unsloth-zoo; two sides, each in a process of
its own) runs a repeat's two sides at once, taking turns K steps at a time from step ``--from``
(``harness.rank.turns``: the bare side's clock and the harness's step report wait for the turn), the
window starting once both have reached it: a machine whose speed drifts between the sides of a
repeat drifts under both alike. Each side's rate is its tokens over its own turns (the seconds it
waited left out); what a side does in the background runs through the other's turns too, at the same
rate as through its own.

usage: python benchmarks/observer_effect.py [--model cpu3m|gpu044b]
                                            [--trainers mlx_lm,script,unsloth_zoo,mlx_vlm]
                                            [--steps N] [--from W] [--repeats R] [--max-repeats M]
                                            [--ablate all|PART,...] [--sides SIDES] [--node N] [--turns K]
                                            [--look-every K] [--record FILE [--time-limit S | --report-only]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import timed_script  # noqa: E402
from bare_trainers import BARE, hide_as_its_rank_does  # noqa: E402
from gpu_clocks import GpuClocks  # noqa: E402
from observer_sides import BARE_SIDES, EVERY_STEP, harnessed, run_side, run_turns, script_times  # noqa: E402
from repeat_ratios import RESOLVED, Ratios, ended, look_level, looks, split_spread, what_it_takes  # noqa: E402
from repeat_record import RepeatRecord, add_options, check_options, planned_device, quiet_pipe, time_limit  # noqa: E402
from taking_turns import timeline_line, unwind_on_sigterm  # noqa: E402

from harness import ablation  # noqa: E402

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
TAKE_TURNS = {"script", "mlx_lm", "unsloth_zoo"}  # trainers whose sides can take turns (``--turns``)


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


def parts(value: str) -> str:
    """``--ablate``'s parts (``all``: every one), checked; one line for a part that does not exist."""
    if value == "all":
        return ",".join(ablation.PARTS)
    try:
        named = ablation.ablated({ablation.VAR: value}, strict=True)
    except ablation.AblationError as e:
        raise SystemExit(f"--ablate: {e}") from None
    if not named:
        raise SystemExit(f"--ablate: name parts to turn off, or all ({', '.join(ablation.PARTS)})")
    return value


def blas_note(device: str | None, off: list[str] | None) -> str | None:
    """A note where ``off`` turns off a part that gives a CPU's ranks their BLAS: the ablated side
    then times another BLAS (about 11 times slower on the 2-core VM), not the harness."""
    blas = sorted({"preload", "env"} & set(off or []))
    if not blas or not (device or "").startswith("cpu"):
        return None
    return (f"note: on a CPU, {' and '.join(blas)} off leaves the ablated side without the BLAS its ranks and the "
            f"bare side run with: it measures the BLAS, not the harness (screen a CPU without them)")


def comparisons(sides: list[str]) -> list[tuple[str, str]]:
    """(numerator, denominator) of each ratio reported, of the sides run: under the harness over bare,
    and with ``--ablate``, the harness with those parts off over bare and all on over them off (the
    parts' effect); with mlx-lm bare reporting every step, the harness over it and it over bare (what
    the reporting costs mlx-lm by itself)."""
    return [c for c in (("harness", "bare"), ("ablated", "bare"), ("harness", "ablated"), ("harness", EVERY_STEP),
                        (EVERY_STEP, "bare")) if set(c) <= set(sides)]


def gathered(record: RepeatRecord, trainers: list[str], sides: list[str]) -> dict[str, dict[str, list[float]]]:
    """Per trainer, each side's tok/s (and the harness's own figure) repeat by repeat."""
    keys = [*sides, *(f"{s} reported" for s in sides if s not in BARE_SIDES)]
    return {t: {k: [r["rates"][t][k] for r in record.data()] for k in keys} for t in trainers}


def finished(record: RepeatRecord, trainers: list[str], sides: list[str], points: list[int], level: float) -> bool:
    """Whether the repeats so far end the run: at a look where every interval is resolved, or at the last."""
    def resolved() -> bool:
        rates = gathered(record, trainers, sides)
        return all(ratios(rates[t], c, level).resolved() for t in trainers for c in comparisons(sides))

    return ended(len(record.repeats), points, resolved)


def chosen_sides(a: argparse.Namespace) -> list[str]:
    """The sides each repeat runs: ``--sides`` (two or three of bare, harness, ablated,
    ``EVERY_STEP``), else bare
    and the harness, and the harness with parts off where ``--ablate`` names them."""
    if not a.sides:
        return ["bare", "harness", *(["ablated"] if a.ablate else [])]
    sides = [x.strip() for x in a.sides.split(",") if x.strip()]
    unknown = [x for x in sides if x not in ("bare", "harness", "ablated", EVERY_STEP)]
    if unknown or len(set(sides)) != len(sides) or not 2 <= len(sides) <= 3:
        raise SystemExit(f"--sides: two or three of bare, harness, ablated, {EVERY_STEP}, each once; got {a.sides!r}")
    if EVERY_STEP in sides and [t for t in a.trainers.split(",") if t] != ["mlx_lm"]:
        raise SystemExit(f"--sides: {EVERY_STEP} is mlx-lm's alone (--trainers mlx_lm): the script and unsloth-zoo "
                         f"report every step bare too, and mlx-vlm has no such side; got --trainers {a.trainers}")
    if "ablated" in sides and not a.ablate:
        raise SystemExit("--sides: the ablated side needs --ablate PARTS (the parts it turns off)")
    if a.ablate and "ablated" not in sides:
        raise SystemExit("--ablate runs the ablated side: add it to --sides")
    return sides


def turns_allowed(a: argparse.Namespace, trainers: list[str], sides: list[str]) -> None:
    """``--turns K``: for the trainers whose bare side can take turns, two sides."""
    if a.turns < 1 or not set(trainers) <= TAKE_TURNS or len(sides) != 2:
        raise SystemExit(f"--turns {a.turns}: K of at least 1, for trainers of {', '.join(sorted(TAKE_TURNS))} and "
                         f"two sides (got --trainers {','.join(trainers)}, sides {','.join(sides)})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="cpu3m")
    p.add_argument("--trainers", default=",".join(TRAINERS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--from", dest="first", type=int, default=10, help="the step the timed window starts after")
    p.add_argument("--repeats", type=int, default=3, help="repeats before the intervals are first looked at "
                                                          "(rounded up to whole rotations of the sides)")
    p.add_argument("--max-repeats", type=int, help="repeats are added a rotation at a time until every interval is "
                                                   "resolved, up to this (default: --repeats; rounded up alike)")
    p.add_argument("--ablate", type=parts, default=None, metavar="PARTS",
                   help="a third side: the harness with these parts off (comma-separated, or all; harness.ablation)")
    p.add_argument("--sides", metavar="SIDES", help="the sides each repeat runs, two or three of bare, harness, "
                   f"ablated, {EVERY_STEP} (default: bare, harness and, with --ablate, ablated); harness,ablated "
                   "alone measures what the parts cost at two thirds of a three-side repeat's time; "
                   f"{EVERY_STEP} (mlx-lm): bare, reporting every step as the harness's adapter has it")
    p.add_argument("--node", type=int, metavar="N", help="run every side on NUMA node N's CPUs (Linux)")
    p.add_argument("--turns", type=int, metavar="K", help="a repeat's two sides at once, taking turns K steps at a "
                   "time from step --from")
    add_options(p)
    p.add_argument("--bare", nargs=3, metavar=("SCENARIO", "RUN", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--harnessed", nargs=3, metavar=("SCENARIO", "RUN", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--every-step", action="store_true", help=argparse.SUPPRESS)  # with --bare: EVERY_STEP's side
    a = p.parse_args()
    if a.bare or a.harnessed:  # a side of a repeat in a process of its own (observer_sides)
        unwind_on_sigterm()
    if a.bare:
        path, run, out = Path(a.bare[0]), a.bare[1], Path(a.bare[2])
        hide_as_its_rank_does(run)  # each run is named after its trainer (``TRAINERS``)
        BARE[run](path, run, out, **({"every_step": True} if a.every_step else {}))
        return
    if a.harnessed:
        out = Path(a.harnessed[2])
        out.write_text(json.dumps(harnessed(Path(a.harnessed[0]), a.harnessed[1])))
        return
    if os.environ.get(ablation.VAR):
        raise SystemExit(f"{ablation.VAR} is set: the harness side would run with parts off; unset it (--ablate "
                         f"runs a side with them off)")
    if a.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {a.repeats}")
    check_options(a)
    if a.node is not None and not a.report_only:  # a report runs nothing here
        try:
            os.sched_setaffinity(0, timed_script.node_cpus(a.node))  # every side's processes inherit it
        except (ValueError, AttributeError, OSError) as e:
            raise SystemExit(f"--node {a.node}: {e}") from None
    trainers = a.trainers.split(",")
    sides = chosen_sides(a)
    if a.turns is not None:
        turns_allowed(a, trainers, sides)
    points = looks(a.repeats, a.max_repeats or a.repeats, len(sides), a.look_every)
    level = look_level(len(points))
    plan = {"device": planned_device(a), "--model": a.model, "--trainers": trainers, "--steps": a.steps,
            "--from": a.first, "--ablate": sorted(a.ablate.split(",")) if a.ablate else None,
            **({"--sides": sides} if a.sides else {}), **({"--node": a.node} if a.node is not None else {}),
            **({"--turns": a.turns} if a.turns is not None else {}),
            "--repeats/--max-repeats (looks after)": points}
    if (note := blas_note(plan["device"], plan["--ablate"])) is not None:
        print(note, file=sys.stderr, flush=True)
    record = RepeatRecord.open(a.record, "observer_effect", plan, report_only=a.report_only)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (times := d / "times").mkdir()  # timed_script.py's rows (every side's processes inherit the variable)
        os.environ[timed_script.TIMES_VAR] = str(times)
        paths = {}  # each trainer's scenario: one for the text trainers, one for the vision-language ones
        for group in ([t for t in trainers if t not in VISION], [t for t in trainers if t in VISION]):
            if group:
                path = d / f"observer_effect_{'vlm' if group[0] in VISION else 'text'}.toml"
                path.write_text(scenario_text(a.model, group, a.steps))
                paths.update(dict.fromkeys(group, path))
        if record.repeats:
            doing = "reporting" if a.report_only else "continuing"
            print(f"{doing} {a.record}: {record.provenance()}", file=sys.stderr, flush=True)
        limit = time_limit(a)
        with GpuClocks(read=not a.report_only) as clocks:  # a report runs nothing here
            repeat_until_done(a, record, trainers, sides, points, level, limit, clocks, paths, d)
    report(a, record, trainers, sides, points, level)


def repeat_until_done(a: argparse.Namespace, record: RepeatRecord, trainers: list[str], sides: list[str],
                      points: list[int], level: float, limit: Any, clocks: GpuClocks, paths: dict[str, Path],
                      d: Path) -> None:
    """Repeats into ``record`` until every interval is resolved at a look, the last look, or the time limit."""
    times = d / "times"
    while not finished(record, trainers, sides, points, level):
        if not limit.room():
            limit.stopped(record, len(record.repeats), points[-1])
            break
        i = len(record.repeats)
        rep: dict[str, dict[str, float]] = {t: {} for t in trainers}
        split: dict[str, list[list[float]]] = {side: [] for side in sides}
        own: dict[str, list[float]] = {side: [] for side in sides}  # the script's own seconds a step
        windows: dict[str, dict[str, list[float]]] = {}  # taking turns: each side's window and its waits, s
        halves: dict[str, dict[str, list[float]]] = {}  # taking turns: each side's tok/s in each half of it
        timelines: dict[str, dict[str, Any]] = {}  # taking turns: when the turns began and each side ended
        for t in trainers:
            order = sides[i % len(sides):] + sides[:i % len(sides)]  # each side first in turn
            if a.turns:
                rep[t], got, steps, windows[t], halves[t], timelines[t] = run_turns(order, t, paths[t], d, a, clocks)
                for side in sides:
                    split[side] += got[side]
                    own[side] += steps[side]
                continue
            for side in order:
                rep[t].update(run_side(side, t, paths[t], d, a))
                got, steps = script_times(times, a.first, clocks)  # the script's, just written
                split[side] += got
                own[side] += steps
        record.add({"rates": rep, "split": split,
                    **({"turns": windows, "halves": halves, "timeline": timelines} if windows else {}),
                    **({"own": own} if any(own.values()) else {}),
                    "numa": timed_script.numa_layout()})
        rates = gathered(record, trainers, sides)
        print(f"repeat {i + 1}: " + "; ".join(f"{t} {ratios(rates[t], c, level).cell()}" for t in trainers
                                            for c in comparisons(sides)[:1]), file=sys.stderr, flush=True)


def ratios(rates: dict[str, list[float]], comparison: tuple[str, str], level: float) -> Ratios:
    num, den = comparison
    return Ratios(tuple(u / b for u, b in zip(rates[num], rates[den], strict=True)), level)


def report(a: argparse.Namespace, record: RepeatRecord, trainers: list[str], sides: list[str], points: list[int],
           level: float) -> None:
    rates, done = gathered(record, trainers, sides), len(record.repeats)
    split = {side: [x for r in record.data() for x in r["split"][side]] for side in sides}
    off = f"; ablated: {a.ablate}" if a.ablate else ""
    turns = f", taking turns {a.turns} steps at a time" if a.turns else ""
    print(f"model {a.model}, 1 process, steps {a.steps}, timed after step {a.first}, {done} repeats of at most "
          f"{points[-1]} (each side first in turn{turns}: {', '.join(sides)}; looked at after {points}){off}")
    if a.record:
        print(f"record {a.record}: {record.provenance()}")
    print(tabulate([[t, side, ", ".join(f"{r:.0f}" for r in rates[t][side]),
                     ", ".join(f"{r:.0f}" for r in rates[t][f"{side} reported"]) if side not in BARE_SIDES else "-"]
                    for t in trainers for side in sides],
                   headers=["trainer", "side", "tok/s per repeat", "the harness's own figure"]))
    print(f"\nratios per repeat, their mean and its interval (Student's t at {level:.4g} per look: 95% over the "
          f"{len(points)} looks); resolved: {RESOLVED}")
    rows = []
    for t in trainers:
        for c in comparisons(sides):
            r = ratios(rates[t], c, level)
            verdict = r.verdict() if done in points else f"none before a look ({', '.join(map(str, points))})"
            rows.append([t, f"{c[0]} / {c[1]}", ", ".join(f"{v:.3f}" for v in r.values), r.cell(), verdict])
    print(tabulate(rows, headers=["trainer", "ratio", "per repeat", "mean [95% interval]", "verdict"]))
    num, den = comparisons(sides)[0]
    each = record.seconds_per_repeat()
    # a repeat's windows taking turns, every trainer's (each the longer of its sides'): what twice the steps adds
    windows = [sum(max(w[0] for w in sides_of.values()) for sides_of in r["turns"].values())
               for r in record.data() if r.get("turns")]
    window = statistics.median(windows) if windows else None
    for t in trainers:  # the first ratio's noise within a run, from the halves of each repeat's window
        kept = [r["halves"][t] for r in record.data() if r.get("halves", {}).get(t, {}).get(den)]
        spread = None
        if len(kept) >= 3:  # the repeats that kept them (a record begun before 9891928 has older ones)
            spread = split_spread([h[num][0] / h[den][0] for h in kept], [h[num][1] / h[den][1] for h in kept])
            print(f"{t}, {num} / {den}, within a run (its window's halves): {spread.line()}")
        takes = what_it_takes(ratios(rates[t], (num, den), level), points, len(sides), each, spread, window)
        if takes and done in points:
            print(f"{t}, {num} / {den}, to resolve at this mean and spread: {takes}")
        timelines = [r["timeline"][t] for r in record.data() if t in r.get("timeline", {})]
        if timelines:  # the repeats that kept them
            marked = {s: (timelines[0]["first_mark"][s][0], [x["first_mark"][s][1] for x in timelines]) for s in sides}
            last = {s: [x["last_mark"][s] for x in timelines if "last_mark" in x] for s in sides}  # newer repeats
            print(f"{t}, {timeline_line(timelines, marked, last)}")
    if any(split[side] for side in sides if side not in BARE_SIDES):
        print("\nthe script's step over the same window, per repeat: its own ms (mean; median last), ms inside "
              "run.probe and run.step, ms in the garbage collector and full collections a step (where recorded), "
              "objects tracked, the NUMA node most steps ended on and their share (where recorded: "
              f"{'; '.join(sorted({r['numa'] for r in record.data() if 'numa' in r})) or 'not'}), the GPU's mean "
              "SM clock and power and its highest temperature (nvidia-smi, where recorded)")
        print(tabulate([[side, *(", ".join(form(x[i]) if i < len(x) else "-" for x in split[side])
                                 for i, form in enumerate(SPLIT_FORMS))] for side in sides],
                       headers=["side", "the script's own", "inside the session's calls", "in gc", "full gcs",
                                "objects at step 1", "own, median", "node", "steps there", "GPU SM MHz", "GPU W",
                                "GPU max C"]))
        own = {side: [r.get("own", {}).get(side, []) for r in record.data()] for side in sides}
        table = timed_script.own_table(own, sides, a.turns, level)
        if table:
            print(f"\nthe script's own step, per repeat the mean of its steps (the repeats that kept them):\n{table}")


SPLIT_FORMS = (lambda v: f"{v * 1e3:.1f}", lambda v: f"{v * 1e3:.3f}", lambda v: f"{v * 1e3:.2f}",
               lambda v: f"{v:.2f}", lambda v: f"{v / 1e3:.0f}k", lambda v: f"{v * 1e3:.1f}",
               lambda v: "?" if v < 0 else f"{v:.0f}", lambda v: f"{v:.0%}", lambda v: f"{v:.0f}",
               lambda v: f"{v:.0f}", lambda v: f"{v:.0f}")


if __name__ == "__main__":
    quiet_pipe(main)
