"""Failure detection: how soon a run ends after one of its ranks dies or hangs.

Each try is a reference-trainer run (a small qwen3, 40 steps) in which rank 1 misbehaves at step
3: ``sigkill`` (as an OOM kill ends a process), ``segfault`` (SIGSEGV), ``exit`` (``os._exit(1)``),
``exit0`` (``os._exit(0)`` mid-run, without a result) or ``hang`` (sleeps forever, found by the
no-progress limit, ``--no-progress-s``). Two figures from the rank's ``fault`` event (written just
before it acts): until the controller knew the run had ended or stopped it (named), and until no
process of the run was left (all gone: the processes' own exits lie between); the
line is the first line of the run's failure message.

usage: python benchmarks/fault_detection.py [--world-sizes 2,4] [--repeats 3] [--no-progress-s 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import textwrap
from pathlib import Path

from tabulate import tabulate

from harness import schema
from harness.controller.run_job import execute
from harness.scenario import load_scenario
from harness.scenario.plan import job_for

FAULTS = ("sigkill", "segfault", "exit", "exit0", "hang")
SCENARIO = """
[scenario]
name = "detect"
seed = 3

[model]
arch = "qwen3"

[data]
rows = 64
max_chars = 60

[train]
steps = 40
global_batch = {ws}

[[runs]]
name = "ddp{ws}"
world_size = {ws}

[[faults]]
rank = 1
step = 3
phase = "update"
action = "{action}"
code = 1
"""


def detection(action: str, world_size: int, no_progress_s: float) -> tuple[float, float, str]:
    """Seconds from rank 1's fault to the moment the controller knew the run had ended (the launcher
    gone, or a limit fired) and to the moment no process of it was left, and the failure's first line."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "detect.toml"
        path.write_text(textwrap.dedent(SCENARIO.format(ws=world_size, action=action)))
        s = load_scenario(path)
        spec = s.runs[0]
        out = execute(spec.name, job_for(s, spec.name), world_size, wall_s=300, no_progress_s=no_progress_s,
                      keep_to=Path(d) / "kept")
        assert not out.ok, f"{action}: the run passed"
        faults = [e for e in schema.read_events(Path(d) / "kept" / "rank1.events.jsonl") if e["kind"] == "fault"]
        assert faults, f"{action}: rank 1 wrote no fault event"
        t = faults[0]["time"]
        return out.watch.named_at - t, out.watch.ended_at - t, (out.failure or "").splitlines()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-progress-s", type=float, default=5.0)
    ap.add_argument("--faults", default=",".join(FAULTS))
    args = ap.parse_args()
    rows = []
    for ws in (int(w) for w in args.world_sizes.split(",")):
        for action in args.faults.split(","):
            tries = [detection(action, ws, args.no_progress_s) for _ in range(args.repeats)]
            named, gone = [t[0] for t in tries], [t[1] for t in tries]
            rows.append([action, ws, f"{statistics.median(named):.2f}", f"{max(named):.2f}",
                         f"{statistics.median(gone):.2f}", f"{max(gone):.2f}", tries[-1][2][:110]])
            print(tabulate([rows[-1]], tablefmt="plain"), flush=True)
    print()
    print(tabulate(rows, headers=["fault", "ranks", "named: median s", "max s", "all gone: median s", "max s",
                                  "first line of the failure"]))
    print(f"\n(hang: found by the no-progress limit of {args.no_progress_s:g} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
