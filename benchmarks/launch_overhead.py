"""Launch overhead: a bare ``mlx.launch -n 2`` of a trivial all_sum script vs the harness.

Prints wall times (median of ``--repeats``) for:
  bare      mlx.launch -n 2 of a script that joins the ring and all-sums one value
  idle      the same, its ranks then idle for 2 s, under mlx.launch and under the harness's
            calm_launch: CPU-seconds of the launcher and its ranks (mlx.launch's busy waits)
  harness   the harness launching the same all_sum as a 2-rank probe job
  text      the harness's 2-rank run of scenarios/text_parity.toml: wall time, training time,
            and their difference (port lease, launch, imports, model build, collection)

usage: python benchmarks/launch_overhead.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

from harness.controller.launch import find_launcher, mlx_launch
from harness.controller.ports import lease_ports
from harness.controller.run_job import execute
from harness.scenario import load_scenario
from harness.scenario.job import AllSumJob
from harness.scenario.plan import job_for

REPO = Path(__file__).resolve().parents[1]
TRIVIAL = "import mlx.core as mx; g = mx.distributed.init(); mx.eval(mx.distributed.all_sum(mx.ones(1), group=g))"


IDLE = TRIVIAL + "; import time; time.sleep(2)"


def children_cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def bare_launch(launcher: list[str], script: str = TRIVIAL) -> tuple[float, float]:
    """Wall seconds and CPU-seconds (launcher and ranks) of a 2-rank launch of ``script``."""
    with lease_ports(2) as lease, tempfile.TemporaryDirectory() as d:
        t0, cpu0 = time.perf_counter(), children_cpu_s()
        subprocess.run([*launcher, "-n", "2", "--backend", "ring", "--starting-port", str(lease.start),
                        "--", sys.executable, "-c", script], stdin=subprocess.DEVNULL, check=True,
                       capture_output=True, cwd=d)
        return time.perf_counter() - t0, children_cpu_s() - cpu0


def harness_probe() -> float:
    out = execute("bench", AllSumJob(value=1.0, rounds=1, pause_s=0.0), 2)
    assert out.ok, out.failure
    return out.watch.wall_s


def text_ddp2() -> tuple[float, float]:
    s = load_scenario(REPO / "scenarios" / "text_parity.toml")
    spec = s.run("ddp2")
    out = execute(spec.name, job_for(s, spec.name), spec.world_size)
    assert out.ok, out.failure
    train = max(o.result["runtime_s"] for o in out.ranks)
    return out.watch.wall_s, train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    n = ap.parse_args().repeats
    bare = statistics.median(bare_launch(mlx_launch())[0] for _ in range(n))
    idle = {name: [bare_launch(launcher, IDLE) for _ in range(n)]
            for name, launcher in (("mlx.launch", mlx_launch()), ("calm_launch", find_launcher()))}
    probe = statistics.median(harness_probe() for _ in range(n))
    texts = [text_ddp2() for _ in range(n)]
    wall, train = statistics.median(w for w, _ in texts), statistics.median(t for _, t in texts)
    rows = [["bare mlx.launch -n 2 (trivial all_sum)", f"{bare:.2f}", "-", "-", "-"]]
    for name, runs in idle.items():
        rows.append([f"{name} -n 2, all_sum then ranks idle 2 s", f"{statistics.median(w for w, _ in runs):.2f}",
                     "-", "-", f"{statistics.median(c for _, c in runs):.2f}"])
    rows += [["harness 2-rank probe (same all_sum)", f"{probe:.2f}", "-", f"{probe - bare:+.2f} vs bare", "-"],
             ["harness text_parity ddp2", f"{wall:.2f}", f"{train:.2f}", f"{wall - train:.2f} outside training", "-"]]
    print(tabulate(rows, headers=["What", "Wall s (median)", "Training s", "Overhead s", "CPU s (median)"]))


if __name__ == "__main__":
    main()
