"""Where a speed gate's noise comes from: ``scenarios/speed_gate.toml`` run ``--runs`` times from
this checkout, one after another, and for each of its runs (1 and 2 ranks) three speeds per
repeat: the fastest tenth of its steps' tok/s (what the gates test), the median step's tok/s,
and tokens per CPU-second of its ranks (each step's tokens over the CPU time its ranks spent in
it, from the reference's step events, median over the steps after the first two). Printed: each
speed's mean, its spread from repeat to repeat (the standard deviation of its log) and that of
the ratio of consecutive repeats (what a pair of a paired gate sees, two identical sides).
``--neighbour busy`` keeps a busy loop on the last CPU throughout, as another job would.

usage: python benchmarks/gate_noise.py [--runs 8] [--neighbour none|busy]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
SCENARIO = REPO / "scenarios" / "speed_gate.toml"
sys.path.insert(0, str(REPO))


def cpu_speed(run_dir: Path) -> float | None:
    """Median over the steps after the first two of the step's tokens per CPU-second of its ranks."""
    ranks = []
    for f in sorted(run_dir.glob("rank*.events.jsonl")):
        steps = [e for e in map(json.loads, f.read_text().splitlines()) if e["kind"] == "step"]
        ranks.append([(e.get("cpu_s"), e["tokens_global"]) for e in steps])
    if not ranks or any(c is None for r in ranks for c, _ in r):
        return None
    per_step = [ranks[0][k][1] / sum(r[k][0] - r[k - 1][0] for r in ranks) for k in range(2, len(ranks[0]))]
    return statistics.median(per_step) if per_step else None


def measure(out: Path) -> dict[str, dict[str, float | None]]:
    from harness.judge.baselines import fastest_tok_s

    p = subprocess.run([sys.executable, "-m", "harness", "run", str(SCENARIO), "--no-plots", "--progress", "off",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"run exited {p.returncode}: {p.stderr.strip()[-500:]}")
    (s,) = json.loads((out / "result.json").read_text())["scenarios"]
    return {r["name"]: {"fastest tenth": fastest_tok_s(r), "median": r["median_tok_s"],
                        "per CPU-s": cpu_speed(out / "runs" / s["name"] / r["name"])}
            for r in s["runs"] if not r.get("floor")}


def spread(values: list[float]) -> tuple[float, float]:
    logs = [math.log(v) for v in values]
    pairs = [logs[i + 1] - logs[i] for i in range(0, len(logs) - 1, 2)]
    return statistics.stdev(logs), statistics.stdev(pairs) if len(pairs) > 1 else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--neighbour", choices=("none", "busy"), default="none")
    args = ap.parse_args()
    busy = None
    if args.neighbour == "busy":
        last = max(os.sched_getaffinity(0))
        busy = subprocess.Popen(["taskset", "-c", str(last), "sh", "-c", "while :; do :; done"])
    try:
        with tempfile.TemporaryDirectory(prefix="gate-noise-") as tmp:
            repeats = [measure(Path(tmp) / f"r{i}") for i in range(args.runs)]
    finally:
        if busy is not None:
            busy.kill()
    rows = []
    for run in repeats[0]:
        for metric in repeats[0][run]:
            values = [r[run][metric] for r in repeats]
            if None in values:
                continue
            cv, pair = spread(values)
            rows.append([run, metric, f"{statistics.fmean(values):.0f}", f"{cv:.1%}", f"{pair:.1%}"])
    print(f"speed_gate, {args.runs} repeats one after another, neighbour: {args.neighbour}")
    print(tabulate(rows, headers=["run", "speed", "mean", "repeat to repeat", "pair of repeats"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
