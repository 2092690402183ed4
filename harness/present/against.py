"""``mlx-ddp-harness gate --against REV SCENARIO...``: the candidate (this checkout) against a
git revision, built in a temporary worktree and run in turns with it on this machine.

Pair k runs the scenarios once at REV and once here, the order alternating (REV first in even
pairs), so drift in the machine's speed lands on both sides. Pairs are added until the
sequential paired test of ``harness.judge.paired`` has decided every run's speed (each run's
speed: its faster steps', ``baselines.fast_tok_s``), from ``--min-pairs`` to ``--pairs``;
losses and memory are judged by the usual gates, with a baseline built from REV's runs. The
worktree runs its own ``harness`` package when it has one (the harness's own repository), else
this one, so a trainer script's repository can be gated the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.present.results import EXIT_CHECK_FAILED, EXIT_PASS, load_results
from harness.scenario import ScenarioError

RUN_OK = (0, 1)  # a run whose checks fail still measured its speed


def _git(args: list[str], cwd: Path) -> str:
    p = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        raise ScenarioError(f"git {' '.join(args)}: {(p.stderr.strip().splitlines() or ['failed'])[-1]}")
    return p.stdout.strip()


def _side_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    if (tree / "harness" / "__init__.py").is_file():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    return env


def _run_side(tree: Path, scenarios: list[str], out: Path, label: str) -> None:
    p = subprocess.run([sys.executable, "-m", "harness", "run", *scenarios, "--out", str(out), "--progress", "off"],
                       cwd=tree, env=_side_env(tree), capture_output=True, text=True)
    if p.returncode not in RUN_OK or not (out / "result.json").is_file():
        tail = " | ".join(p.stderr.strip().splitlines()[-3:])
        raise ScenarioError(f"the {label} side's run exited {p.returncode}: {tail}")


def _relative(repo: Path, scenario: str) -> str:
    path = Path(scenario).resolve()
    try:
        return str(path.relative_to(repo))
    except ValueError as e:
        raise ScenarioError(f"{scenario}: not inside the git repository {repo}, so it has no version at the "
                            f"revision to compare with") from e


def _tok_s(docs: list[tuple[Path, dict[str, Any]]]) -> dict[tuple[str, str], list[float]]:
    from harness.judge.baselines import collect_repeats

    out = {}
    for key, entry in collect_repeats(docs).items():
        if entry["failed"] or not entry["repeats"]:
            continue
        out[key] = [r.get("fast_tok_s") or r["median_tok_s"] for r in entry["repeats"]]
    return out


def _speeds(outs: list[Path]) -> dict[tuple[str, str], list[float]]:
    return _tok_s(load_results([str(o) for o in outs]))


def cmd_gate_against(args: argparse.Namespace, overrides: dict[str, float | None]) -> int:
    """``gate --against``; ``overrides``: the tolerance flags given."""
    from harness.judge.baselines import Tolerances, build_baseline
    from harness.judge.gates import Gate, gate
    from harness.judge.paired import SequentialDesign, sequential_look
    from harness.present.gate_report import emit_gate

    if args.pairs < 2:
        raise ScenarioError(f"--pairs must be at least 2, got {args.pairs}")
    if not 2 <= args.min_pairs <= args.pairs:
        raise ScenarioError(f"--min-pairs must be from 2 to --pairs ({args.pairs}), got {args.min_pairs}")
    if not 0 <= args.slowdown_margin < args.detect < 100:
        raise ScenarioError(f"--slowdown-margin ({args.slowdown_margin:g}) must be below --detect ({args.detect:g}), "
                            f"from 0 to 100")
    design = SequentialDesign(args.slowdown_margin / 100, args.detect / 100, args.alpha, args.beta,
                              args.min_pairs, args.pairs)
    repo = Path(_git(["rev-parse", "--show-toplevel"], Path.cwd()))
    try:
        commit = _git(["rev-parse", "--verify", "--quiet", f"{args.against}^{{commit}}"], repo)
    except ScenarioError as e:
        raise ScenarioError(f"--against {args.against}: not a revision of the git repository {repo}") from e
    scenarios = [_relative(repo, s) for s in args.results]
    work = Path(tempfile.mkdtemp(prefix="mlx-ddp-harness-against-"))
    tree = work / "tree"
    try:
        _git(["worktree", "add", "--detach", "--quiet", str(tree), commit], repo)
        missing = [s for s in scenarios if not (tree / s).is_file()]
        if missing:
            raise ScenarioError(f"{missing[0]}: not in revision {args.against} ({commit[:12]})")
        sides: dict[str, tuple[Path, list[Path]]] = {"baseline": (tree, []), "candidate": (repo, [])}
        verdicts: dict[tuple[str, str], Any] = {}
        for k in range(args.pairs):
            order = ("baseline", "candidate") if k % 2 == 0 else ("candidate", "baseline")
            for label in order:
                root, outs = sides[label]
                out = work / f"{label}{k}"
                _run_side(root, scenarios, out, label)
                outs.append(out)
                print(f"pair {k + 1}/{args.pairs}: {label} done", file=sys.stderr, flush=True)
            if k + 1 >= args.min_pairs:
                base_speed, cand_speed = _speeds(sides["baseline"][1]), _speeds(sides["candidate"][1])
                keys = sorted(set(base_speed) & set(cand_speed))
                runs = dataclasses.replace(design, runs=len(keys))
                verdicts = {key: sequential_look(base_speed[key], cand_speed[key], runs) for key in keys}
                if all(v.decided for v in verdicts.values()):
                    break
        pairs = len(sides["candidate"][1])
        base_docs = load_results([str(o) for o in sides["baseline"][1]])
        cand_docs = load_results([str(o) for o in sides["candidate"][1]])
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    tol = Tolerances().updated(**overrides)
    baseline = build_baseline(base_docs, tol)
    gates, notes, compared = gate(baseline, cand_docs, tol)
    gates = [g for g in gates if g.metric != "throughput"]
    base_speed, cand_speed = _tok_s(base_docs), _tok_s(cand_docs)
    for key, v in sorted(verdicts.items()):
        gates.append(Gate(*key, "throughput (paired)", not v.alarm, f"{statistics.median(cand_speed[key]):.1f} tok/s",
                          f"{statistics.median(base_speed[key]):.1f} tok/s",
                          f"at most {args.slowdown_margin:g}% slower, p >= {v.design.alarm_level:.2g}", v.describe()))
    env = cand_docs[0][1]["environment"]
    name = f"{args.against} ({commit[:12]}), {pairs} interleaved pairs (sequential, {args.min_pairs} to {args.pairs})"
    emit_gate(gates, notes, compared, baseline, env, name, args.format, args.out)
    return EXIT_PASS if all(g.passed for g in gates) else EXIT_CHECK_FAILED
