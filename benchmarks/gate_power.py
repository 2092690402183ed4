"""The speed gate's power and false alarms on this machine: ``gate --against`` run many times.

From a clean worktree of HEAD (the candidate, unchanged) and a worktree of HEAD with the reference
trainer slowed down (each step sleeps ``--slowdown`` / (1 - ``--slowdown``) of its own time,
inside the timed step, after its fetch and agreement: its tok/s falls by about ``--slowdown``),
``gate --against HEAD`` runs ``--tries-slow`` and ``--tries-same`` times, the two kinds in turns.
Counted: how often the slow build raised an alarm (detections) and how often the unchanged one did
(false alarms), with the estimated changes, the pairs each gate took and its wall time; and, over
every pair of the unchanged build, how much faster a side ran second than first. The committed
tree must be clean for "unchanged" to mean it. ``--min-pairs N --pairs N`` gates with N pairs
always (the wall time of a fixed gate). Each gate runs its pairs as ``gate`` does by default (side
by side where the runs compute on the CPU); ``--side-by-side`` or ``--in-turns`` asks for one way.

usage: python benchmarks/gate_power.py [--tries-slow 10] [--tries-same 20] [--min-pairs 4] [--pairs 10]
       [--slowdown 0.1] [--side-by-side | --in-turns]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
SCENARIO = "scenarios/speed_gate.toml"
RUNS = ("single", "ddp2")  # its runs
STEP_END = ("            self._record(step, micros, (tokens, agreed.values[1]), loss, norm, "
            "time.perf_counter() - t0 - probe_s)")
CHANGE = re.compile(r"^\S+\s+(\S+)\s+throughput \(paired\).*?(\d+\.\d)% (slower|faster)", re.M)
PAIRS = re.compile(r"(\d+) (interleaved|side-by-side) pairs")
PAIR_CHANGES = re.compile(r"note: \S+?/(\S+): pairs ((?:[+-]\d+\.\d% ?)+)")


def slowed(tree: Path, slowdown: float) -> None:
    """Make the reference trainer's every step take about 1 / (1 - slowdown) as long: a sleep in
    proportion to the step's time after it fetched its batch and agreed with the peers
    (``fetch_s``, the agreement's wait included, is left out). Counting that wait, each rank's
    sleep lengthened the other's: above a slowdown of 50 %, a 2-rank run's sleeps grew from step
    to step."""
    path = tree / "harness" / "trainers" / "reference" / "trainer.py"
    src = path.read_text()
    if STEP_END not in src:
        raise SystemExit(f"{path}: the step's end to slow down was not found")
    own = "time.perf_counter() - t0 - probe_s - self.step_phases['fetch_s']"
    sleep = f"            time.sleep({slowdown / (1 - slowdown)!r} * ({own}))\n"
    path.write_text(src.replace(STEP_END, sleep + STEP_END, 1))


def gate_once(tree: Path, min_pairs: int, pairs: int,
              how: tuple[str, ...] = ()) -> tuple[str, dict[str, float], int, float, dict[str, list[float]], str]:
    """One gate: its verdict ("pass", "ALARM" or "INCONCLUSIVE"), the estimated change of each
    run, the pairs it took, its wall time, each run's pair ratios (candidate over baseline,
    the baseline first in the 1st, 3rd, ...) and how its pairs ran (interleaved, side-by-side)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "harness", "gate", "--against", "HEAD", SCENARIO, "--pairs", str(pairs),
                        "--min-pairs", str(min_pairs), *how], cwd=tree, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if p.returncode not in (0, 1, 4):  # 4: not decided by the last pair (inconclusive)
        raise SystemExit(f"gate exited {p.returncode}: {p.stderr.strip()[-500:]}")
    table = "\n".join(ln for ln in p.stdout.splitlines() if not ln.startswith("FAIL "))  # not the spelled-out ones
    changes = {run: float(v) * (-1 if w == "slower" else 1) for run, v, w in CHANGE.findall(table)}
    taken = PAIRS.search(p.stdout)
    ratios = {run: [1 + float(c.rstrip("%")) / 100 for c in cs.split()] for run, cs in PAIR_CHANGES.findall(p.stdout)}
    verdict = {0: "pass", 1: "ALARM", 4: "INCONCLUSIVE"}[p.returncode]
    return verdict, changes, int(taken.group(1)) if taken else pairs, wall, ratios, taken.group(2) if taken else "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries-slow", type=int, default=10)
    ap.add_argument("--tries-same", type=int, default=20)
    ap.add_argument("--min-pairs", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--slowdown", type=float, default=0.1)
    way = ap.add_mutually_exclusive_group()
    way.add_argument("--side-by-side", action="store_true", help="gate --side-by-side: each pair's sides at once")
    way.add_argument("--in-turns", action="store_true", help="gate --in-turns: each pair's sides one after the other")
    args = ap.parse_args()
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                      text=True).stdout.strip():
        print("note: the checkout has uncommitted changes; both builds are HEAD's", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="mlx-ddp-gate-power-"))
    trees = {"same": work / "same", "slow": work / "slow"}
    for tree in trees.values():
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), "HEAD"], cwd=REPO, check=True)
    slowed(trees["slow"], args.slowdown)
    # the slow tries spread evenly among the unchanged ones
    order = [kind for _, kind in sorted([((k + 0.5) / args.tries_slow, "slow") for k in range(args.tries_slow)]
                                        + [((k + 0.5) / args.tries_same, "same") for k in range(args.tries_same)])]
    rows, alarms, undecided, walls, taken = [], {"slow": 0, "same": 0}, {"slow": 0, "same": 0}, [], []
    ways: set[str] = set()
    second: dict[str, list[float]] = {}  # per run: log ratios of the unchanged build, signed by who ran second
    t0 = time.monotonic()
    try:
        for i, kind in enumerate(order, 1):
            asked = ("--side-by-side",) if args.side_by_side else ("--in-turns",) if args.in_turns else ()
            verdict, changes, pairs, wall, ratios, ran = gate_once(trees[kind], args.min_pairs, args.pairs, asked)
            ways.add(ran)
            for run, rs in ratios.items():
                if kind == "same":  # the candidate ran second in even pairs (from 0)
                    second.setdefault(run, []).extend(math.log(r) * (1 if k % 2 == 0 else -1) for k, r in enumerate(rs))
            alarms[kind] += verdict == "ALARM"
            undecided[kind] += verdict == "INCONCLUSIVE"
            walls.append(wall)
            taken.append(pairs)
            rows.append([i, kind, verdict, *(f"{changes.get(r, math.nan):+.1f}%" for r in RUNS),
                         pairs, f"{wall:.0f}"])
            print(tabulate([rows[-1]], tablefmt="plain"), f"({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
    print()
    print(tabulate(rows, headers=["try", "build", "gate", *(f"{r}: estimated change" for r in RUNS), "pairs", "s"]))
    kind = " or ".join(sorted(ways))
    print(f"\nslowed by {args.slowdown:.0%}: {alarms['slow']} alarms in {args.tries_slow} tries; "
          f"unchanged: {alarms['same']} false alarms in {args.tries_same} tries; inconclusive: "
          f"{undecided['slow']} slowed, {undecided['same']} unchanged; "
          f"{args.min_pairs} to {args.pairs} {kind} pairs, median {statistics.median(taken):g} pairs and "
          f"{statistics.median(walls):.0f} s a gate ({time.monotonic() - t0:.0f} s in all)")
    passed = sum(1 for row in rows if row[1] == "same" and row[2] == "pass")
    print(f"the goal, 19 of 20 each: the unchanged build passed {passed} of {args.tries_same}; the build "
          f"{args.slowdown:.0%} slower failed {alarms['slow']} of {args.tries_slow}")
    for run, logs in sorted(second.items()):
        how = "the second half of the CPUs" if ways == {"side-by-side"} else "running second"
        print(f"{run}: {how} changed a side's speed by {math.exp(statistics.fmean(logs)) - 1:+.1%} "
              f"(over {len(logs)} pairs of the unchanged build; a pair's spread {statistics.pstdev(logs):.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
