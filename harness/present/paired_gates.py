"""The paired gates. ``gate --against REV SCENARIO...``: the candidate (this checkout) against a
git revision, built in a temporary worktree and run in turns with it on this machine. ``gate
--env PYTHON SCENARIO...``: this environment (the candidate) against another Python environment
(an upgrade's, or the one before it), the same checkout's scenarios run in turns under each; the
other runs without this one's ``PYTHONPATH``, ``PYTHONHOME`` and ``VIRTUAL_ENV``, and the report
names both environments' versions of Python, mlx, mlx-lm, mlx-vlm, numpy and unsloth-zoo.

Pair k runs the scenarios once at REV and once here, the order alternating (REV first in even
pairs), so drift in the machine's speed lands on both sides. Pairs are added until the
sequential paired test of ``harness.judge.paired`` has decided every run's speed (each run's
speed: its fastest steps', ``baselines.fast_tok_s``), looking from ``--min-pairs`` every second
pair up to ``--pairs``;
losses and memory are judged by the usual gates, with a baseline built from REV's runs. A run
still undecided at ``--pairs`` is INCONCLUSIVE (``gate_report.PairedGate``): the gate then exits
``EXIT_INCONCLUSIVE`` unless another gate failed. The worktree runs its own ``harness`` package
when it has one (the harness's own repository), else this one, so a trainer script's repository
can be gated the same way.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.present.results import load_results
from harness.scenario import ScenarioError
from harness.scenario.trainers import versioned_packages

RUN_OK = (0, 1)  # a run whose checks fail still measured its speed


def _git(args: list[str], cwd: Path) -> str:
    p = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        raise ScenarioError(f"git {' '.join(args)}: {(p.stderr.strip().splitlines() or ['failed'])[-1]}")
    return p.stdout.strip()


def repository(cwd: Path) -> Path:
    """The top of the git repository holding ``cwd`` (one-line errors without git or outside one)."""
    if shutil.which("git") is None:
        raise ScenarioError("git: not found on PATH; gate --against checks out a revision with git")
    p = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0 or not p.stdout.strip():
        raise ScenarioError(f"not a git repository: {cwd} (gate --against compares revisions of the git "
                            f"repository it runs in: run it there)")
    return Path(p.stdout.strip())


def resolve_revision(rev: str, repo: Path) -> str:
    """The full commit ``rev`` names in ``repo`` (a one-line error when it names none)."""
    p = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=repo,
                       capture_output=True, text=True)
    if p.returncode != 0 or not p.stdout.strip():
        raise ScenarioError(f"{rev}: no such revision in {repo}")
    return p.stdout.strip()


def _side_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    if (tree / "harness" / "__init__.py").is_file():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    return env


VERSIONS = ("import importlib.metadata as m, json, sys\n"
            "def v(n):\n    try:\n        return m.version(n)\n"
            "    except m.PackageNotFoundError:\n        return None\n"
            "print(json.dumps({'python': sys.version.split()[0], **{n: v(n) for n in sys.argv[1:]}}))")


def versions(python: str, extra: tuple[str, ...] = ()) -> dict[str, str | None]:
    """The versions of Python and of the packages a gate reports, in the environment of ``python``."""
    import json

    p = subprocess.run([python, "-c", VERSIONS, *versioned_packages(), *extra], capture_output=True, text=True)
    if p.returncode != 0:
        raise ScenarioError(f"{python}: cannot run it to read its package versions: "
                            f"{(p.stderr.strip().splitlines() or ['failed'])[-1]}")
    return json.loads(p.stdout)


@dataclass
class Side:
    """One side of a paired gate: the Python that runs it, the tree it runs in, its results."""

    label: str  # "baseline" or "candidate"
    python: str
    root: Path
    env: dict[str, str]
    outs: list[Path] = field(default_factory=list)
    options: list[str] = field(default_factory=list)  # more options of ``run`` (``--device``)

    def run(self, scenarios: list[str], out: Path) -> None:
        p = subprocess.run([self.python, "-m", "harness", "run", *scenarios, "--out", str(out), "--progress", "off",
                            *self.options],
                           cwd=self.root, env=self.env, capture_output=True, text=True)
        if p.returncode not in RUN_OK or not (out / "result.json").is_file():
            tail = " | ".join(p.stderr.strip().splitlines()[-3:])
            raise ScenarioError(f"the {self.label} side's run exited {p.returncode}: {tail}")
        self.outs.append(out)


def run_options(args: argparse.Namespace) -> list[str]:
    """The options of ``gate`` that both sides' ``run`` takes: ``--device`` (a revision without
    it refuses the option, and its side's run fails saying so)."""
    return ["--device", args.device] if getattr(args, "device", None) else []


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


def sequential_design(args: argparse.Namespace) -> Any:
    """The sequential test the flags ask for (one-line errors for flags that do not fit)."""
    from harness.judge.paired import SequentialDesign

    if args.pairs < 2:
        raise ScenarioError(f"--pairs must be at least 2, got {args.pairs}")
    if not 2 <= args.min_pairs <= args.pairs:
        raise ScenarioError(f"--min-pairs must be from 2 to --pairs ({args.pairs}), got {args.min_pairs}")
    if not 0 <= args.slowdown_margin < args.detect < 100:
        raise ScenarioError(f"--slowdown-margin ({args.slowdown_margin:g}) must be below --detect ({args.detect:g}), "
                            f"from 0 to 100")
    return SequentialDesign(args.slowdown_margin / 100, args.detect / 100, args.alpha, args.beta,
                            args.min_pairs, args.pairs)


def cmd_gate_against(args: argparse.Namespace, overrides: dict[str, float | None]) -> int:
    """``gate --against REV``; ``overrides``: the tolerance flags given."""
    from harness.controller.environment import git_revision

    design = sequential_design(args)
    repo = repository(Path.cwd())
    commit = resolve_revision(args.against, repo)
    here = git_revision(repo)  # this checkout's commit, +dirty with uncommitted changes
    scenarios = [_relative(repo, s) for s in args.results]
    work = Path(tempfile.mkdtemp(prefix="mlx-ddp-harness-against-"))
    tree = work / "tree"
    try:
        _git(["worktree", "add", "--detach", "--quiet", str(tree), commit], repo)
        missing = [s for s in scenarios if not (tree / s).is_file()]
        if missing:
            raise ScenarioError(f"{missing[0]}: not in revision {args.against} ({commit[:12]})")
        sides = [Side("baseline", sys.executable, tree, _side_env(tree), options=run_options(args)),
                 Side("candidate", sys.executable, repo, dict(os.environ), options=run_options(args))]
        verdicts = run_pairs(sides, scenarios, design, work)
        base_docs, cand_docs = (load_results([str(o) for o in side.outs]) for side in sides)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    name = f"{args.against} ({commit[:12]}), {len(sides[1].outs)} interleaved pairs (sequential, {args.min_pairs} to " \
           f"{args.pairs})"
    short = commit[:len(here.partition("+")[0])] if here else commit[:12]
    return judge_pairs(args, overrides, verdicts, base_docs, cand_docs, name, [],
                       ((args.against, short), ("this checkout", here)))


def run_pairs(sides: list[Side], scenarios: list[str], design: Any, work: Path) -> dict[tuple[str, str], Any]:
    """Pairs of runs, the order alternating, until every run's speed is decided (or ``design.max_pairs``)."""
    from harness.judge.paired import sequential_look

    verdicts: dict[tuple[str, str], Any] = {}
    for k in range(design.max_pairs):
        for side in sides if k % 2 == 0 else sides[::-1]:
            side.run(scenarios, work / f"{side.label}{k}")
            print(f"pair {k + 1}/{design.max_pairs}: {side.label} done", file=sys.stderr, flush=True)
        if k + 1 in design.looks:
            base_speed, cand_speed = _speeds(sides[0].outs), _speeds(sides[1].outs)
            keys = sorted(set(base_speed) & set(cand_speed))
            runs = dataclasses.replace(design, runs=len(keys))
            verdicts = {key: sequential_look(base_speed[key], cand_speed[key], runs) for key in keys}
            if all(v.decided for v in verdicts.values()):
                break
    return verdicts


def judge_pairs(args: argparse.Namespace, overrides: dict[str, float | None], verdicts: dict[tuple[str, str], Any],
                base_docs: list, cand_docs: list, name: str, notes: list[str], sides: Any) -> int:
    """Speed by the paired verdicts; losses and memory against a baseline made of the baseline side's
    runs; ``sides``: each side's label and repository revision, for the regression table."""
    from harness.judge.baselines import Tolerances, build_baseline
    from harness.judge.gates import gate
    from harness.present.gate_report import FAST_TOK_S, PairedGate, add_fast_speeds, emit_gate, exit_code

    tol = Tolerances().updated(**overrides)
    baseline = build_baseline(base_docs, tol)
    gates, more, compared = gate(baseline, cand_docs, tol)
    notes = [*notes, *more]
    gates = [g for g in gates if g.metric != "throughput"]
    base_speed, cand_speed = _tok_s(base_docs), _tok_s(cand_docs)
    for key, v in sorted(verdicts.items()):
        gates.append(PairedGate(*key, "throughput (paired)", v.decided == "pass",
                                f"{statistics.median(cand_speed[key]):.1f} {FAST_TOK_S}",
                                f"{statistics.median(base_speed[key]):.1f} {FAST_TOK_S}",
                                f"at most {args.slowdown_margin:g}% slower, p >= {v.design.alarm_level:.2g}",
                                v.describe(), inconclusive=v.decided != "pass" and not v.alarm))
        notes.append(f"{key[0]}/{key[1]}: {v.pair_note()}")
    add_fast_speeds(compared, cand_docs)
    env = cand_docs[0][1]["environment"]
    emit_gate(gates, notes, compared, baseline, env, name, args.format, args.out, sides)
    return exit_code(gates)


ENVIRONMENT_VARS = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")  # this environment's, not the other's


def _interpreter(spec: str) -> str:
    """``--env``'s Python: an interpreter path, or ``tox:NAME`` for ``.tox/NAME``'s."""
    if spec.startswith("tox:"):
        path = Path(".tox") / spec[4:] / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
        if not path.is_file():
            raise ScenarioError(f"--env {spec}: no {path} (create it first: tox -e {spec[4:]} --notest)")
        return str(path.resolve())
    found = shutil.which(spec)
    if found is None:
        raise ScenarioError(f"--env {spec}: not a Python interpreter here")
    return found


def cmd_gate_env(args: argparse.Namespace, overrides: dict[str, float | None]) -> int:
    """``gate --env PYTHON``: the same scenarios of this checkout under another Python environment
    (the baseline) and under this one (the candidate), in turns; ``overrides``: the tolerance flags."""
    design = sequential_design(args)
    other = _interpreter(args.env)
    packages = tuple(args.package or ())
    base_v, cand_v = versions(other, packages), versions(sys.executable, packages)
    for s in args.results:
        if not Path(s).is_file():
            raise ScenarioError(f"{s}: no such scenario file")
    work = Path(tempfile.mkdtemp(prefix="mlx-ddp-harness-env-"))
    try:
        here = Path.cwd()
        own = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT_VARS}  # each Python finds its own
        sides = [Side("baseline", other, here, own, options=run_options(args)),
                 Side("candidate", sys.executable, here, dict(os.environ), options=run_options(args))]
        verdicts = run_pairs(sides, [str(Path(s).resolve()) for s in args.results], design, work)
        base_docs, cand_docs = (load_results([str(o) for o in side.outs]) for side in sides)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    differ = [k for k in base_v if base_v[k] != cand_v.get(k)]
    notes = [f"environments: baseline {other}, candidate {sys.executable}",
             *(f"{k}: {base_v[k] or 'not installed'} (baseline) vs {cand_v.get(k) or 'not installed'} (candidate)"
               for k in base_v),
             f"they differ in: {', '.join(differ)}" if differ else "their Python and packages are the same versions"]
    name = f"the environment of {args.env}, {len(sides[1].outs)} interleaved pairs (sequential, {args.min_pairs} to " \
           f"{args.pairs})"
    return judge_pairs(args, overrides, verdicts, base_docs, cand_docs, name, notes,
                       ((f"environment {args.env}", None), ("this environment", None)))
