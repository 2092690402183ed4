"""``mlx-ddp-harness gate`` and ``mlx-ddp-harness baseline update``.

Exit codes of ``gate``: 0 every gate passed, 1 a gate failed, 2 bad input (a missing or damaged
file, a result from another platform than the baseline without ``--force``, nothing to compare,
``--against`` outside a git repository or with an unknown revision), 4 inconclusive (no gate
failed, but a paired speed test of ``--against`` or ``--env`` reached ``--pairs`` undecided, or a
check failed in some of the candidate's runs only or was not judged there).
``--bisect``: 1 a first bad commit (or a range) found, 0 none in the range, 4 undecided
(``harness.present.bisect_cli``). 5: a fault in the harness, here or in a side's run.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from harness.exit_codes import EXIT_PASS
from harness.run.results import load_results
from harness.scenario import ScenarioError

TOLERANCE_FLAGS = (
    ("--throughput-pct", "throughput_pct", "slowdown always allowed, in %% of baseline tok/s"),
    ("--spread-multiple", "spread_multiple", "allowed slowdown / loss difference as a multiple of the repeat spread"),
    ("--loss-abs", "loss_abs", "per-step loss difference always allowed"),
    ("--memory-pct", "memory_pct", "per-rank peak memory change allowed either way, in %%"),
)


def tolerance_overrides(args: argparse.Namespace) -> dict[str, float | None]:
    """The tolerance flags given on the command line (``None``: not given)."""
    return {dest: getattr(args, dest) for _, dest, _ in TOLERANCE_FLAGS}


def baseline_filename(key: dict[str, object]) -> str:
    """A file name for a platform's baseline, e.g. ``linux-amd-epyc-cpu-mlx0.32.4.json``."""
    device = "gpu" if "gpu" in str(key.get("device")) else "cpu"  # "Device(gpu, 0) (Apple M3 Max)"
    parts = [str(key.get("os_name")), str(key.get("cpu")), device, f"mlx{key.get('mlx_version')}"]
    slug = "-".join(re.sub(r"[^a-z0-9.]+", "-", p.lower()).strip("-") for p in parts)
    return f"{slug}.json"


def cmd_gate(args: argparse.Namespace) -> int:
    from harness.judge.baselines import Tolerances, pick_baseline
    from harness.judge.gates import check_platform, gate
    from harness.present.gate_report import add_fast_speeds, emit_gate, exit_code

    if not (args.bisect or args.bisect_versions):
        given = [f for f, v in (("--metrics", args.metrics), ("--find-links", args.find_links),
                                ("--no-index", args.no_index)) if v]
        if given:
            raise ScenarioError(f"{given[0]} is for --bisect or --bisect-versions")
    if args.bisect or args.bisect_versions:
        from harness.present.bisect_cli import cmd_gate_bisect

        return cmd_gate_bisect(args, tolerance_overrides(args))
    if args.against and args.env:
        raise ScenarioError("give --against REV or --env PYTHON, not both")
    if args.against or args.env:
        from harness.present.paired_gates import cmd_gate_against, cmd_gate_env

        if args.baseline:
            raise ScenarioError(f"--{'against' if args.against else 'env'} runs its own baseline: give --baseline or "
                                f"--{'against' if args.against else 'env'}, not both")
        return (cmd_gate_against if args.against else cmd_gate_env)(args, tolerance_overrides(args))
    if args.device:
        raise ScenarioError("--device is for a gate that runs scenarios itself (--against, --env); results "
                            "already run keep the device they ran on")
    if args.side_by_side or args.in_turns:
        raise ScenarioError(f"--{'side-by-side' if args.side_by_side else 'in-turns'} is for a gate that runs "
                            f"scenarios itself (--against, --env, a bisection); results already run were measured "
                            f"as they ran")
    if not args.baseline:
        raise ScenarioError("gate needs --baseline FILE (results against a stored baseline), --against REV or "
                            "--env PYTHON")
    docs = load_results(args.results)
    env = docs[0][1]["environment"]
    base_file, baseline = pick_baseline(Path(args.baseline), env)
    notes: list[str] = []
    for f, doc in docs:
        notes += check_platform(baseline, base_file, doc, f, args.force)
    tol = Tolerances(**baseline["tolerances"]).updated(**tolerance_overrides(args))
    gates, more, compared = gate(baseline, docs, tol, args.force)
    add_fast_speeds(compared, docs)
    emit_gate(gates, notes + more, compared, baseline, env, str(base_file), args.format, args.out)
    return exit_code(gates)


def cmd_baseline_update(args: argparse.Namespace) -> int:
    from harness import schema
    from harness.judge.baselines import (
        Tolerances,
        baseline_target,
        build_baseline,
        merged_baseline,
        platform_differences,
        platform_key,
        read_baseline,
    )
    from harness.present.gate_report import baseline_table

    target, into_dir = baseline_target(args.baseline)  # an ambiguous path is refused before anything is read
    docs = load_results(args.results)
    path = target / baseline_filename(platform_key(docs[0][1]["environment"])) if into_dir else target
    # an existing baseline keeps its configured tolerances unless a flag changes them, and the
    # scenarios these results do not cover
    old = read_baseline(path) if path.exists() else None
    tol = Tolerances(**old["tolerances"]) if old else Tolerances()
    doc = build_baseline(docs, tol.updated(**tolerance_overrides(args)))
    if old and not platform_differences(old["platform"], doc["platform"]):
        doc = merged_baseline(old, doc)
    made = into_dir and not target.is_dir()
    if made:
        target.mkdir()
    schema.write_json_atomic(path, doc)
    print(baseline_table(doc, args.format))
    where = (f"a file named after this platform, in the {'new ' if made else ''}directory {target}" if into_dir
             else "a file, as --baseline names one")
    print(f"\nwrote {path} ({where})")
    return EXIT_PASS


def _tolerance_args(p: argparse.ArgumentParser) -> None:
    for flag, dest, text in TOLERANCE_FLAGS:
        p.add_argument(flag, dest=dest, type=float, default=None, help=text)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("gate", help="compare results against a baseline of the same platform, or run scenarios "
                                     "against a git revision (exit 1 on a regression, 4 when undecided)")
    g.add_argument("results", nargs="+", metavar="RESULT",
                   help="result.json files or --out directories (with --against: scenario files)")
    g.add_argument("--baseline", help="baseline file, or a directory of per-platform baselines")
    g.add_argument("--against", metavar="REV",
                   help="run the scenarios here and at git revision REV (a temporary worktree), a pair at a time")
    g.add_argument("--bisect", metavar="GOOD..BAD",
                   help="find the first commit of BAD's first-parent line after GOOD (GOOD..: up to HEAD) at which "
                        "a gated metric regresses, each probe a paired gate against GOOD (exit 1 found, 0 none, "
                        "4 undecided)")
    g.add_argument("--bisect-versions", metavar="PACKAGE==V1..V2",
                   help="find the first release of PACKAGE (extras allowed: mlx[cpu]) after V1, up to V2, whose "
                        "environment regresses against V1's, each built once over this one (cached)")
    g.add_argument("--find-links", action="append", metavar="DIR",
                   help="with --bisect-versions: a directory of wheels pip looks in too (repeatable)")
    g.add_argument("--no-index", action="store_true",
                   help="with --bisect-versions: only the --find-links directories, not the registries")
    g.add_argument("--metrics", metavar="LIST",
                   help="with --bisect or --bisect-versions: the gated metrics that make a probe bad, from checks "
                        "(a check's verdict), loss, memory and speed (default: all); a run that fails always does")
    g.add_argument("--env", metavar="PYTHON",
                   help="run the scenarios under this Python environment (an interpreter, or tox:NAME for "
                        ".tox/NAME) and this one, a pair at a time: gate a dependency upgrade")
    g.add_argument("--package", action="append", metavar="NAME",
                   help="with --env: a package whose versions the report names too (the trainer's own; repeatable)")
    g.add_argument("--pairs", type=int, default=10,
                   help="with --against: the most pairs of runs (default 10); pairs are added until "
                        "every run's speed is decided, and a run still undecided here is INCONCLUSIVE (exit 4)")
    g.add_argument("--min-pairs", type=int, default=4,
                   help="with --against: pairs before the first look (default 4); it looks every second pair")
    g.add_argument("--slowdown-margin", type=float, default=0.0,
                   help="with --against: the slowdown in %% that is not a regression (default 0)")
    g.add_argument("--detect", type=float, default=10.0,
                   help="with --against: the slowdown in %% to catch with 1 - beta power (default 10)")
    g.add_argument("--alpha", type=float, default=0.02,
                   help="with --against: the chance of a false alarm over the whole gate (default 0.02)")
    g.add_argument("--beta", type=float, default=0.10,
                   help="with --against: the chance of missing a --detect slowdown, per run (default 0.10)")
    g.add_argument("--side-by-side", action="store_true",
                   help="with --against, --env or a bisection: run each pair's two sides at once, each on its own "
                        "half of the CPUs (the default where the runs compute on the CPU and speed is judged: "
                        "steadier on a shared machine; docs/reports.md)")
    g.add_argument("--in-turns", action="store_true",
                   help="with --against, --env or a bisection: run each pair's two sides one after the other (the "
                        "default where the runs compute on a GPU or no speed is judged)")
    g.add_argument("--device", choices=("auto", "gpu", "cpu"),
                   help="with --against or --env: the device of every run on both sides (run --device)")
    g.add_argument("--force", action="store_true", help="compare even when the platforms differ")
    g.add_argument("--format", choices=("plain", "github"), default="plain", help="table format")
    g.add_argument("--out", metavar="DIR", help="write DIR/gate.json: every gate's fields, for a CI job to read "
                                                "(--against, --env: the pairs' runs and logs in DIR/pairs)")
    _tolerance_args(g)
    g.set_defaults(func=cmd_gate)
    b = sub.add_parser("baseline", help="write baselines")
    bsub = b.add_subparsers(dest="action", required=True)
    u = bsub.add_parser("update", help="write a baseline from results (at least 2 repeats of each run)")
    u.add_argument("results", nargs="+", metavar="RESULT", help="result.json files or --out directories")
    u.add_argument("--baseline", required=True,
                   help="the baseline file to write, or a directory (the file is named after the platform); a new "
                        "path ends in .json (a file) or / (a directory)")
    u.add_argument("--format", choices=("plain", "github"), default="plain", help="table format")
    _tolerance_args(u)
    u.set_defaults(func=cmd_baseline_update)
