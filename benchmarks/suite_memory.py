"""The memory a scenario suite needs at once: every live rank's RSS, summed, sampled while it runs.

A CI machine must hold every rank that runs at the same moment (a hosted Mac runner has 7 GB).
This runs a harness command (default: ``run``, the default scenario set) and samples, every
``--every`` seconds, the RSS of each rank process under it (``python -m harness.rank``, and an
executable a rank starts) and of the controller. It prints the peak of the ranks' sum (and when
it was reached: the scenario and run running then), the most ranks alive at once, the largest
single rank, the controller's peak, the peak of every process under the command summed
(launchers included), and the command's wall time and exit code.

On a CPU device (and on Metal, whose memory is unified) MLX's buffers are host memory, so the
RSS holds them; on CUDA device memory is not in it.

usage: python benchmarks/suite_memory.py [--every 0.1] [--json FILE] [-- HARNESS ARGS...]
  e.g. python benchmarks/suite_memory.py -- run --device cpu
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from tabulate import tabulate

RANK_MARK = "harness.rank"
SCENARIO_LINE = re.compile(r"^scenario (\S+)")
RUN_LINE = re.compile(r"^\s+progress (\S+) \(")


@dataclass
class Peaks:
    """What the sampler saw; bytes."""

    ranks_sum: int = 0
    ranks_sum_at: str = ""
    ranks_alive: int = 0
    everything: int = 0  # the controller, its launchers and ranks, summed
    one_rank: int = 0
    controller: int = 0
    samples: int = 0
    per_scenario: dict[str, int] = field(default_factory=dict)


def runs_module(argv: list[str], module: str) -> bool:
    """``argv`` is a Python running ``-m module`` (a launcher's argv names the rank module later)."""
    return "-m" in argv and argv.index("-m") + 1 < len(argv) and argv[argv.index("-m") + 1] == module


def rank_processes(root: psutil.Process) -> list[psutil.Process]:
    """The rank processes under ``root`` (each counted with the processes it started: an
    executable), not the launchers that started them."""
    out = []
    for p in root.children(recursive=True):
        try:
            if runs_module(p.cmdline(), RANK_MARK):
                out.append(p)
        except psutil.Error:
            continue
    return out


def rss_of_tree(p: psutil.Process) -> int:
    total = 0
    for q in [p, *p.children(recursive=True)]:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            continue
    return total


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=float, default=0.1, help="seconds between samples")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    ap.add_argument("harness_args", nargs="*", help="the harness command (default: run)")
    args = ap.parse_args(argv)
    cmd = [sys.executable, "-m", "harness", *(args.harness_args or ["run"])]
    log = Path("suite_memory.stderr.log").resolve()
    t0 = time.monotonic()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        root = psutil.Process(proc.pid)
        peaks = Peaks()
        while proc.poll() is None:
            ranks = rank_processes(root)
            sizes = [rss_of_tree(r) for r in ranks]
            total = sum(sizes)
            peaks.samples += 1
            try:
                peaks.controller = max(peaks.controller, root.memory_info().rss)
            except psutil.Error:
                pass
            peaks.everything = max(peaks.everything, rss_of_tree(root))
            where = current_run(log)
            scenario = where.split("/")[0] if where else ""
            if scenario:
                peaks.per_scenario[scenario] = max(peaks.per_scenario.get(scenario, 0), total)
            if total > peaks.ranks_sum:
                peaks.ranks_sum, peaks.ranks_sum_at = total, where
            peaks.ranks_alive = max(peaks.ranks_alive, len(ranks))
            peaks.one_rank = max([peaks.one_rank, *sizes])
            time.sleep(args.every)
    wall = time.monotonic() - t0
    mb = 1024 * 1024
    rows = [["ranks' RSS summed, peak", f"{peaks.ranks_sum / mb:.0f} MB", peaks.ranks_sum_at or "-"],
            ["ranks alive at once, most", peaks.ranks_alive, ""],
            ["one rank's RSS, peak", f"{peaks.one_rank / mb:.0f} MB", ""],
            ["controller's RSS, peak", f"{peaks.controller / mb:.0f} MB", ""],
            ["all its processes' RSS summed, peak", f"{peaks.everything / mb:.0f} MB", "controller, launchers, ranks"],
            ["samples", peaks.samples, f"every {args.every:g} s"],
            ["wall time", f"{wall:.0f} s", f"exit {proc.returncode}: {' '.join(cmd[1:])}"]]
    print(tabulate(rows, headers=["Figure", "Value", "Where"]))
    top = sorted(peaks.per_scenario.items(), key=lambda kv: -kv[1])[:5]
    print("\nlargest scenarios (ranks' RSS summed, peak): "
          + ", ".join(f"{k} {v / mb:.0f} MB" for k, v in top))
    if args.json:
        Path(args.json).write_text(json.dumps({**asdict(peaks), "wall_s": wall, "exit": proc.returncode,
                                               "command": cmd[1:]}, indent=1))
    return proc.returncode


def current_run(log: Path) -> str:
    """The scenario and run the harness's stderr names last (``scenario/run``)."""
    try:
        lines = log.read_text(errors="replace").splitlines()[-40:]
    except OSError:
        return ""
    for line in reversed(lines):
        m = RUN_LINE.match(line)
        if m:
            return m.group(1)
        m = SCENARIO_LINE.match(line)
        if m:
            return m.group(1)
    return ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
