"""What one part of a rank costs a trainer's step, measured inside one run: the part (``--part``:
the memory sampler's thread, or the ledger's recording of each collective and compiled call) runs
in the first ``--block`` steps, not in the next ``--block``, and so on
(``harness.ablation.alternating``), and the run's own steps say how fast each kind of block went.

Between two runs a GPU's steps can differ by several per cent; within one run they differ far
less, so comparing blocks of one run tells a part's cost from none in a few runs where comparing
runs (``observer_effect.py --ablate``) needs tens. It holds for a part whose cost is in every step
while it runs; a part that acts once before training (the warm-up, the device check) cannot
alternate. Each repeat is one run under the harness on ``observer_effect.py``'s model and rows;
its ratio is the tok/s of the steps after ``--from`` in blocks with the part over those in blocks
without (below 1: the part slows the step), each step timed by the harness (``step_time_s``).
Blocks with the part come first in every run, so a steady drift within a run weighs on them by
about a block's share of it. The mean of the ratios with its interval is judged as the other
benchmarks' are (``repeat_ratios``); ``--record`` and ``--time-limit`` carry it over invocations.

usage: python benchmarks/alternating_part.py [--part sampler|ledger] [--model cpu3m|gpu044b]
                                             [--trainer script|mlx_lm|unsloth_zoo]
                                             [--steps N] [--from W] [--block K] [--repeats R]
                                             [--max-repeats M] [--look-every K]
                                             [--record FILE [--time-limit S | --report-only]]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from observer_effect import MODELS, TRAINERS, VISION, scenario_text  # noqa: E402
from observer_sides import harness_side  # noqa: E402
from repeat_ratios import RESOLVED, Ratios, ended, look_level, looks  # noqa: E402
from repeat_record import RepeatRecord, add_options, check_options, planned_device, quiet_pipe, time_limit  # noqa: E402

from harness import ablation  # noqa: E402


def block_rates(marks: list[dict[str, Any]], first: int, block: int) -> tuple[float, float]:
    """Tok/s of the steps after ``first`` in blocks with the part (steps 1 to ``block``, then every
    other block) and in blocks without it, each step's tokens over its ``step_time_s``."""
    sums = {True: [0.0, 0.0], False: [0.0, 0.0]}
    previous = 0
    for m in marks:
        tokens, previous = m["tokens"] - previous, m["tokens"]
        if m["step"] > first:
            with_part = ((m["step"] - 1) // block) % 2 == 0
            sums[with_part][0] += tokens
            sums[with_part][1] += m["step_time_s"]
    if not all(t for _, t in sums.values()):
        raise SystemExit(f"--from {first} and --block {block} leave no steps of one kind in the window")
    return sums[True][0] / sums[True][1], sums[False][0] / sums[False][1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=ablation.ALTERNATING, default="sampler")
    p.add_argument("--model", choices=sorted(MODELS), default="cpu3m")
    p.add_argument("--trainer", choices=sorted(t for t in TRAINERS if t not in VISION), default="script")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--from", dest="first", type=int, default=10, help="the step the timed window starts after")
    p.add_argument("--block", type=int, default=5, help="steps in a block with the part, and in one without")
    p.add_argument("--repeats", type=int, default=3, help="runs before the interval is first looked at")
    p.add_argument("--max-repeats", type=int, help="runs are added one at a time until the interval is resolved, "
                                                   "up to this (default: --repeats)")
    add_options(p)
    a = p.parse_args()
    check_options(a)
    if a.block < 1 or a.repeats < 1:
        raise SystemExit(f"--block and --repeats must be at least 1, got {a.block} and {a.repeats}")
    if a.steps - a.first < 2 * a.block:
        raise SystemExit(f"--steps {a.steps} after --from {a.first} hold less than a block with the part and one "
                         f"without ({a.block} steps each)")
    points = looks(a.repeats, a.max_repeats or a.repeats, 1, a.look_every)
    level = look_level(len(points))
    plan = {"device": planned_device(a), "part": a.part, "--model": a.model, "--trainer": a.trainer, "--steps": a.steps,
            "--from": a.first, "--block": a.block, "--repeats/--max-repeats (looks after)": points}
    record = RepeatRecord.open(a.record, "alternating_part", plan, report_only=a.report_only)
    limit = time_limit(a)

    def ratios() -> Ratios:
        return Ratios(tuple(r["with"] / r["without"] for r in record.data()), level)

    if record.repeats:
        doing = "reporting" if a.report_only else "continuing"
        print(f"{doing} {a.record}: {record.provenance()}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "alternating.toml"
        path.write_text(scenario_text(a.model, [a.trainer], a.steps))
        while not ended(len(record.repeats), points, lambda: ratios().resolved()):
            if not limit.room():
                limit.stopped(record, len(record.repeats), points[-1])
                break
            with_part, without = block_rates(harness_side(path, a.trainer, f"{a.part}/{a.block}"), a.first, a.block)
            record.add({"with": with_part, "without": without})
            print(f"run {len(record.repeats)}: {with_part:.0f} / {without:.0f} tok/s, {ratios().cell()}",
                  file=sys.stderr, flush=True)
    r, done = ratios(), len(record.repeats)
    print(f"{a.trainer} on {a.model}, the {a.part} in alternate blocks of {a.block} steps (with it first), steps "
          f"{a.first + 1} to {a.steps} timed, {done} runs of at most {points[-1]} (looked at after {points})")
    if a.record:
        print(f"record {a.record}: {record.provenance()}")
    print(f"with / without, per run: {', '.join(f'{v:.3f}' for v in r.values)}")
    verdict = r.verdict() if done in points else f"none before a look ({', '.join(map(str, points))})"
    print(f"mean [95% interval over {len(points)} looks]: {r.cell()}: {verdict} (resolved: {RESOLVED})")


if __name__ == "__main__":
    if ablation.VAR in os.environ:
        raise SystemExit(f"{ablation.VAR} is set: unset it (this benchmark sets it for its runs)")
    quiet_pipe(main)
