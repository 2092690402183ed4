"""What warm rank starts (``MLX_DDP_HARNESS_WARM_RANKS``) save: a scenario run cold and warm in
turns, each run's CPU (the controller, the launchers and the ranks: ``cpu_use.own_s`` of every
run in ``result.json``) and wall time summed; the warm side's servers' own CPU (their imports,
read from ``/proc`` before they are stopped) is added to its total. Linux without a GPU.

    python benchmarks/warm_starts.py scenarios/unsloth_parity.toml --repeats 2
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

from harness.controller.warm_ranks import WARM_VAR, stop_servers


def run_once(scenario: Path, out: Path, warm_dir: Path | None) -> tuple[float, float, int, bool]:
    """(CPU-s of its runs, wall s of the command, warm-started runs, passed)."""
    env = {k: v for k, v in os.environ.items() if k != WARM_VAR}
    if warm_dir is not None:
        env[WARM_VAR] = str(warm_dir)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "harness", "run", str(scenario), "--no-plots", "--out", str(out)],
                       env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    runs = [r for s in json.loads((out / "result.json").read_text())["scenarios"] for r in s["runs"]]
    cpu = sum(r["cpu_use"]["own_s"] for r in runs if r.get("cpu_use"))
    return cpu, wall, sum(1 for r in runs if r.get("warm_start")), p.returncode == 0


def servers_cpu_s(warm_dir: Path) -> float:
    """The CPU-seconds the key servers of ``warm_dir`` have used (their imports, their loop)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for lock in warm_dir.glob("*.lock"):
        try:
            fields = Path(f"/proc/{int(lock.read_text())}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", type=Path)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if not args.scenario.is_file():
        raise SystemExit(f"{args.scenario}: no such scenario file")
    with tempfile.TemporaryDirectory(prefix="warm-starts-") as tmp:
        warm_dir = Path(tmp) / "servers"
        figures: dict[str, list[tuple[float, float, int, bool]]] = {"cold": [], "warm": []}
        try:
            for k in range(args.repeats):
                for side in ("cold", "warm"):
                    out = Path(tmp) / f"{side}{k}"
                    figures[side].append(run_once(args.scenario, out, warm_dir if side == "warm" else None))
                    cpu, wall, warm, ok = figures[side][-1]
                    print(f"{side} {k + 1}: {cpu:.1f} CPU-s, {wall:.1f} s, {warm} runs warm, "
                          f"{'passed' if ok else 'FAILED'}", flush=True)
            servers = servers_cpu_s(warm_dir)
        finally:
            if warm_dir.is_dir():
                stop_servers(warm_dir)
    cold_cpu = sum(f[0] for f in figures["cold"])
    warm_cpu = sum(f[0] for f in figures["warm"]) + servers
    print(f"{args.scenario.name}, {args.repeats} runs each: cold {cold_cpu:.1f} CPU-s, warm {warm_cpu:.1f} "
          f"(servers' imports {servers:.1f} of it): {warm_cpu / cold_cpu:.2f}x the CPU; wall "
          f"{sum(f[1] for f in figures['cold']):.0f} s against {sum(f[1] for f in figures['warm']):.0f} s")


if __name__ == "__main__":
    main()
