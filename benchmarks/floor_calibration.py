"""How well a parity scenario's noise floor predicts a correct run's deviation, over many seeds.

The scenario runs once per seed (``--seeds`` of them from ``--first-seed``) and dtype, each run in
its own copy of the TOML with ``[scenario] seed`` replaced and, unless ``--dtype-env NAME`` hands the
dtype to the trainer through that environment variable (a script that casts its own model and
declares no dtype), ``[model] dtype`` set. For every trajectory check (``loss_parity``,
``param_parity``, ``eval_parity``) of every compared run it reports, over the seeds: the ratio of
the run's deviation to its floor runs' own (value / noise: 1 where the floor predicts the deviation
exactly), how many seeds FAILED (a false FAIL: the trainer is correct), how many were INCONCLUSIVE
(no power), and the limit's margin over the value. The step-local checks' value / limit is
reported too. A seed whose scenario did not complete is counted and named.

usage: python benchmarks/floor_calibration.py SCENARIO.toml [--seeds 20] [--first-seed 100]
       [--dtypes float32,bfloat16] [--dtype-env NAME] [--out DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
TRAJECTORY = ("loss_parity", "param_parity", "eval_parity")
STEP_LOCAL = ("step_loss_parity", "step_grad_parity")


def variant(src: str, seed: int, dtype: str | None, where: Path) -> str:
    """The scenario's TOML for one seed (and ``dtype`` as its ``[model] dtype``, where given);
    relative paths are made absolute, as they were relative to the original's folder."""
    out, n = re.subn(r"(?m)^seed\s*=.*$", f"seed = {seed}", src, count=1)
    if not n:  # a scenario that extends another: its own seed
        out, n = re.subn(r"(?m)^\[scenario\]\s*$", f"[scenario]\nseed = {seed}", src, count=1)
    if not n:
        raise SystemExit("the scenario has no [scenario] table to set its seed in")
    out = re.sub(r'(?m)^((?:\w*path|extends)\s*=\s*")([^/"][^"]*)"',
                 lambda m: f'{m.group(1)}{(where / m.group(2)).resolve()}"', out)
    if dtype is not None:
        out = re.sub(r"(?m)^dtype\s*=.*\n", "", out)
        out, n = re.subn(r"(?m)^\[model\]\s*$", f'[model]\ndtype = "{dtype}"', out, count=1)
        if not n:
            out += f'\n[model]\ndtype = "{dtype}"\n'
    return out


def run_seed(path: Path, out: Path, env: dict[str, str]) -> tuple[dict[str, Any] | None, str]:
    """One scenario run's judged scenario (None where it wrote no result) and the run's last
    line of output (why, where it wrote none)."""
    done = subprocess.run([sys.executable, "-m", "harness", "run", str(path), "--out", str(out), "--no-plots"],
                          cwd=REPO, env=env, capture_output=True, text=True, check=False)
    said = (done.stderr.strip() or done.stdout.strip()).splitlines()
    try:
        return json.loads((out / "result.json").read_text())["scenarios"][0], said[-1] if said else ""
    except (OSError, ValueError, KeyError, IndexError):
        return None, said[-1] if said else f"exit {done.returncode}, no output"


def rows_of(results: dict[str, list[dict[str, Any]]]) -> list[list[Any]]:
    """The table: a row per dtype, check and run."""
    rows = []
    for dtype, scenarios in results.items():
        by: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for s in scenarios:
            for c in s["checks"]:
                if c["name"] in TRAJECTORY + STEP_LOCAL and c["result"] != "n/a":
                    by.setdefault((c["name"], c["run"]), []).append(c)
        for (name, run), cs in sorted(by.items()):
            if name in STEP_LOCAL:
                fracs = [c["value"] / c["limit"] for c in cs if c["limit"]]
                rows.append([dtype, name, run, len(cs), "-", "-", f"{max(fracs):.2f}" if fracs else "-",
                             sum(c["result"] == "FAIL" for c in cs), 0])
                continue
            ratios = [c["value"] / c["noise"] for c in cs if c.get("noise")]
            margins = [c["limit"] / c["value"] for c in cs if c["value"]]
            rows.append([dtype, name, run, len(cs), f"{statistics.median(ratios):.2f}" if ratios else "-",
                         f"{max(ratios):.2f}" if ratios else "-", f"{1 / min(margins):.3f}" if margins else "-",
                         sum(c["result"] == "FAIL" for c in cs), sum(c["result"] == "INCONCLUSIVE" for c in cs)])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", type=Path)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--first-seed", type=int, default=100)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--dtype-env", default=None, help="hand the dtype to the trainer in this variable instead")
    p.add_argument("--out", type=Path, default=None, help="keep each seed's results here")
    p.add_argument("--json", type=Path, default=None, help="write the judged checks here")
    args = p.parse_args(argv)
    src = args.scenario.read_text()
    keep = args.out or Path(tempfile.mkdtemp(prefix="floor-calibration-"))
    results: dict[str, list[dict[str, Any]]] = {}
    missing: list[str] = []
    for dtype in args.dtypes.split(","):
        env = dict(os.environ)
        if args.dtype_env:
            env[args.dtype_env] = dtype
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            path = keep / f"{dtype}-{seed}.toml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(variant(src, seed, None if args.dtype_env else dtype, args.scenario.parent))
            s, said = run_seed(path, keep / f"{dtype}-{seed}", env)
            if s is None or s["status"] == "error":
                missing.append(f"{dtype} seed {seed}")
                print(f"{dtype} seed {seed}: did not complete: {said}", file=sys.stderr, flush=True)
                continue
            results.setdefault(dtype, []).append(s)
            print(f"{dtype} seed {seed}: {s['status']}", file=sys.stderr, flush=True)
    print(f"{args.scenario.name}: {args.seeds} seeds from {args.first_seed}, results in {keep}")
    print(tabulate(rows_of(results), headers=["dtype", "check", "run", "seeds", "value/floor median",
                                              "value/floor max", "value/limit max", "FAIL", "INCONCLUSIVE"]))
    if missing:
        print(f"did not complete: {', '.join(missing)}")
    if args.json:
        args.json.write_text(json.dumps({d: [s["checks"] for s in ss] for d, ss in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
