"""Concurrency under stress: rounds of concurrent 2-rank launches from separate controllers.

Each round starts ``--launches`` controller processes at once (as pytest-xdist workers or parallel
CI jobs would); each launches a 2-rank probe whose ranks all-sum the launch's own value for
``--sums`` rounds. Counted over all rounds: wrong sums (a launch that saw another's all-reduce),
failed launches, stray processes (any rank or launcher alive after its round) and leftover files
(anything left in the temp dir the controllers ran with, MLX's compile cache aside). All four
must be 0. The rank budget is raised to let every launch of a round run at once
(``--rank-budget``; the default budget, the CPU count, would queue them).

usage: python benchmarks/stress_launches.py [--rounds 100] [--launches 6] [--sums 3]
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

import psutil
from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
WORKER = """
import json, sys
from harness.scenario.job import AllSumJob
from harness.controller.run_job import execute
value, sums = float(sys.argv[1]), int(sys.argv[2])
o = execute("stress", AllSumJob(value=value, rounds=sums, pause_s=0.0), 2,
            wall_s=240, no_progress_s=120)
print(json.dumps({"ok": o.ok, "failure": o.failure, "sums": [r.result and r.result.get("sums") for r in o.ranks],
                  "pids": sorted(o.watch.rank_pids.values())}))
"""


def expected(value: float, sums: int) -> list[float]:
    return [2 * value * s + 1 for s in range(1, sums + 1)]  # ranks 0 and 1 add value * s + rank


def strays(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def harness_processes(tmp: Path) -> list[int]:
    """Live ranks and launchers of this benchmark's launches (those whose temp dir is ``tmp``)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["status"] == psutil.STATUS_ZOMBIE or not ("harness.rank" in cmd or "calm_launch" in cmd):
            continue
        try:
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if str(tmp) in (env.get("MLX_DDP_HARNESS_TMPDIR"), env.get("TMPDIR")):
            found.append(p.info["pid"])
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--launches", type=int, default=6)
    ap.add_argument("--sums", type=int, default=3)
    ap.add_argument("--rank-budget", type=int, default=12)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mlx-ddp-stress-"))
    env = {**os.environ, "TMPDIR": str(tmp), "MLX_DDP_HARNESS_RANK_BUDGET": str(args.rank_budget),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    totals = {"launches": 0, "wrong sums": 0, "failures": 0, "stray processes": 0, "leftover files": 0}
    before = set(harness_processes(tmp))
    seen_left: set[str] = set()
    t0 = time.monotonic()
    for k in range(1, args.rounds + 1):
        values = [1000.0 * k + 7 * i for i in range(args.launches)]
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(v), str(args.sums)], env=env, cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for v in values]
        for v, p in zip(values, procs, strict=True):
            out, err = p.communicate(timeout=600)
            totals["launches"] += 1
            try:
                got = json.loads(out.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                totals["failures"] += 1
                print(f"round {k}: controller for {v:g} printed no result: {err.strip()[-300:]}", flush=True)
                continue
            if not got["ok"]:
                totals["failures"] += 1
                print(f"round {k}: launch {v:g} failed: {got['failure']}", flush=True)
            elif got["sums"] != [expected(v, args.sums)] * 2:
                totals["wrong sums"] += 1
                print(f"round {k}: launch {v:g} got {got['sums']}", flush=True)
            totals["stray processes"] += len(strays(got.get("pids", [])))
        left = {p.name for p in tmp.iterdir() if p.name != "mlx"} - seen_left
        seen_left |= left
        totals["leftover files"] += len(left)
        stray = set(harness_processes(tmp)) - before
        before |= stray  # each stray counted once
        totals["stray processes"] += len(stray)
        if left or stray:
            print(f"round {k}: left {sorted(left)}, processes {sorted(stray)}", flush=True)
        if k % 10 == 0 or k == args.rounds:
            print(f"round {k}/{args.rounds}: {totals} ({time.monotonic() - t0:.0f} s)", flush=True)
    print()
    print(tabulate([[*totals.values(), f"{time.monotonic() - t0:.0f}"]], headers=[*totals, "wall s"]))
    bad = sum(v for key, v in totals.items() if key != "launches")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
