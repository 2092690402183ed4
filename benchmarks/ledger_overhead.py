"""What the collective ledger (``harness.rank.ledger``) costs the trainer it watches.

For each scenario, its first run of more than one rank is launched with the ledger on and off
(``MLX_DDP_HARNESS_LEDGER``), alternating which goes first, ``--repeats`` times each, on real
ranks. A repeat's step time is rank 0's median reported step time, its first ``--skip`` steps
left out (compilation, warm-up). It prints, per scenario: the ledger's calls per step, the
median step time with and without it, their ratio with the repeats' range, and the ledger's own
cost per call timed in-process (``record`` with the call-site walk and the flushed write) times
its calls per step over the step time: the cost that side-by-side timings on a busy machine can
only bound; and what the controller's comparison of the ranks' ledgers after each run
(``collective_agreement``) took. ``--same`` runs both sides with the ledger on, to show that noise.

usage: python benchmarks/ledger_overhead.py [SCENARIO.toml ...] [--repeats 3] [--skip 2] [--device D]
                                          [--same] [--json FILE]
  (default: the default suite's scenarios of each trainer: text_parity, vlm_parity, mlx_lm_lora,
  mlx_vlm_parity, unsloth_compiled, script_example)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import schema  # noqa: E402
from harness.controller.inputs import prepare_jobs  # noqa: E402
from harness.controller.ledgers import desync  # noqa: E402
from harness.controller.run_job import execute  # noqa: E402
from harness.rank.ledger import SWITCH, Ledger  # noqa: E402
from harness.scenario import load_scenario, with_device  # noqa: E402
from harness.scenario.plan import plan_scenario  # noqa: E402

DEFAULT = ("text_parity", "vlm_parity", "mlx_lm_lora", "mlx_vlm_parity", "unsloth_compiled", "script_example")


def record_cost_s(calls: int = 20000) -> float:
    """Seconds one ``Ledger.record`` takes here (a 4-deep call site walk, a flushed line)."""
    import mlx.core as mx

    x = mx.zeros((259, 32))
    with tempfile.TemporaryDirectory() as d:
        ledger = Ledger(Path(d) / "l.jsonl", 2)

        def deep(n: int) -> None:
            if n:
                return deep(n - 1)
            for _ in range(calls):
                ledger.record("all_sum", (x,), {})

        t0 = time.perf_counter()
        deep(4)
        took = time.perf_counter() - t0
        ledger.uninstall()
    return took / calls


def one_launch(path: Path, on: bool, keep: Path, skip: int, device: str | None = None
               ) -> tuple[float, float, float]:
    """Rank 0's median step time (s) and ledger calls per step of the scenario's first N-rank run,
    and what comparing its ranks' ledgers took the controller after it (s; as every run's
    ``collective_agreement`` does)."""
    s = load_scenario(path)
    plan = plan_scenario(with_device(s, device) if device else s)
    run = next(r for r in plan.runs if r.spec.world_size > 1 and r.floor is None)
    jobs = prepare_jobs(plan)
    os.environ[SWITCH] = "1" if on else "0"
    with tempfile.TemporaryDirectory() as ws:
        out = execute(run.name, jobs[run.name].in_workspace(Path(ws)), run.spec.world_size,
                      backend=run.spec.backend, keep_to=keep, wall_s=plan.scenario.limits.wall_s)
    if not out.ok:
        raise SystemExit(f"{path.stem}: run {run.name} failed: {out.failure}")
    times = [e["step_time_s"] for e in schema.read_events(keep / "rank0.events.jsonl")
             if e["kind"] == "step" and e.get("step_time_s") is not None]
    ledger = keep / "rank0.collectives.jsonl"
    calls = len(ledger.read_text().splitlines()) if ledger.exists() else 0
    t0 = time.perf_counter()
    desync(keep, run.spec.world_size, waiting=False, finished=set(range(run.spec.world_size)))
    return statistics.median(times[skip:] or times), calls / max(len(times), 1), time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", help="scenario files (default: one per trainer of the default suite)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", type=int, default=2, help="first steps of each run left out")
    ap.add_argument("--device", choices=("cpu", "gpu", "auto"), help="every run's device (as run --device)")
    ap.add_argument("--same", action="store_true",
                    help="both sides with the ledger on: the ratio a difference of nothing gets here (the noise)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    paths = [Path(p) for p in args.scenarios] or [REPO / "scenarios" / f"{n}.toml" for n in DEFAULT]
    per_call = record_cost_s()
    rows, figures = [], []
    keep = Path(tempfile.mkdtemp(prefix="ledger-overhead-"))
    for path in paths:
        on, off, calls, compare = [], [], 0.0, []
        for k in range(args.repeats):
            for first in ((True, False) if k % 2 == 0 else (False, True)):
                step_s, n, took = one_launch(path, first or args.same, keep / f"{path.stem}-{k}-{int(first)}",
                                             args.skip, args.device)
                (on if first else off).append(step_s)
                calls = n if first else calls
                compare += [took] if first else []
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        ratio = statistics.median(on) / statistics.median(off)
        estimate = calls * per_call / statistics.median(off)
        figures.append({"scenario": path.stem, "calls_per_step": calls, "step_s_on": on, "step_s_off": off,
                        "ratio": ratio, "record_s": per_call, "estimated_overhead": estimate, "compare_s": compare})
        rows.append([path.stem, f"{calls:.1f}", f"{statistics.median(on) * 1e3:.1f}",
                     f"{statistics.median(off) * 1e3:.1f}",
                     f"{ratio:.3f} ({min(ratios):.3f}-{max(ratios):.3f})", f"{estimate * 100:.3f} %",
                     f"{statistics.median(compare) * 1e3:.2f}"])
        print(rows[-1], flush=True)
    print(f"\nledger record: {per_call * 1e6:.1f} us per call; {args.repeats} repeats each side, alternating\n")
    print(tabulate(rows, headers=["scenario", "collectives/step", "step ms (ledger)",
                                  "step ms (ledger, again)" if args.same else "step ms (none)",
                                  "ratio (range)", "record cost / step", "compare ms / run"]))
    if args.json:
        args.json.write_text(json.dumps({"record_s": per_call, "scenarios": figures}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
