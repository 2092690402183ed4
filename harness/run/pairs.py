"""The paired gates' runs: both sides of a gate run on this machine, pair after pair (in turns, or
side by side: ``harness.run.sides_at_once``), until the sequential paired test
(``harness.judge.paired``) has decided every run's speed. ``pairs_against``: this checkout against
a git revision, built in a temporary worktree (which runs its own ``harness`` package when it has
one: the harness's own repository; else this one, so a trainer script's repository can be gated the
same way). ``pairs_env``: this environment against another Python environment, which runs without
this one's ``PYTHONPATH``, ``PYTHONHOME`` and ``VIRTUAL_ENV``. Pair k runs the scenarios once on
each side; in turns, the order alternating (the baseline first in even pairs), so drift in the
machine's speed lands on both sides. ``harness.present.paired_gates`` judges and reports them."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.exit_codes import EXIT_INTERNAL
from harness.run.results import load_results
from harness.scenario import ScenarioError
from harness.scenario.trainers import versioned_packages

RUN_OK = (0, 1, 4)  # a run whose checks fail, or had no power, still measured its speed


class SideError(ScenarioError):
    """A side's run that did not give a result to read; ``label`` names the side, ``internal`` says
    its run exited on a fault in the harness (``EXIT_INTERNAL``), which the gate passes on."""

    def __init__(self, label: str, message: str, internal: bool = False):
        super().__init__(message)
        self.label, self.internal = label, internal


def git(args: list[str], cwd: Path) -> str:
    p = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        raise ScenarioError(f"git {' '.join(args)}: {(p.stderr.strip().splitlines() or ['failed'])[-1]}")
    return p.stdout.strip()


def repository(cwd: Path, flag: str = "--against") -> Path:
    """The top of the git repository holding ``cwd`` (one-line errors without git or outside one,
    naming ``gate``'s ``flag``)."""
    if shutil.which("git") is None:
        raise ScenarioError(f"git: not found on PATH; gate {flag} checks out revisions with git")
    p = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0 or not p.stdout.strip():
        raise ScenarioError(f"not a git repository: {cwd} (gate {flag} compares revisions of the git "
                            f"repository it runs in: run it there)")
    return Path(p.stdout.strip())


def resolve_revision(rev: str, repo: Path) -> str:
    """The full commit ``rev`` names in ``repo`` (a one-line error when it names none)."""
    p = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=repo,
                       capture_output=True, text=True)
    if p.returncode != 0 or not p.stdout.strip():
        raise ScenarioError(f"{rev}: no such revision in {repo}")
    return p.stdout.strip()


def side_env(tree: Path) -> dict[str, str]:
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
    accept: tuple[int, ...] = RUN_OK  # the exit codes of a run whose result counts
    store: Path | None = None  # where this side's results are kept to be reused (``ResultStore``)

    def run(self, scenarios: list[str], out: Path) -> str:
        """Run the scenarios into ``out`` (or reuse a kept result there): "ran" or "reused"."""
        return self.finish(self.start(scenarios, out), out)

    def start(self, scenarios: list[str], out: Path, preexec: Any = None, env: dict[str, str] | None = None,
              reuse: bool = True) -> subprocess.Popen | None:
        """Start the run into ``out``, its output in ``out``.log (None: a kept result reused);
        ``preexec`` runs in the child before it starts, ``env`` adds to the side's environment."""
        shutil.rmtree(out, ignore_errors=True)  # a result.json of an earlier gate with the same --out is not this run's
        kept = self._kept()
        if reuse and kept is not None and kept.is_file():
            out.mkdir(parents=True)
            shutil.copyfile(kept, out / "result.json")
            return None
        side_env = {k: v for k, v in self.env.items() if k != "GITHUB_STEP_SUMMARY"}  # the gate's job summary only
        with open(out.with_suffix(".log"), "w") as log:
            return subprocess.Popen([self.python, "-m", "harness", "run", *scenarios, "--out", str(out),
                                     "--progress", "off", *self.options], cwd=self.root,
                                    env={**side_env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=preexec)

    def finish(self, proc: subprocess.Popen | None, out: Path, store: bool = True) -> str:
        """Wait for ``start``'s run and take its result: "ran" or "reused"; ``store``: keep it to be
        reused (not a result measured side by side, on half the CPUs)."""
        if proc is not None:
            try:
                proc.wait()
            except BaseException:  # interrupted
                self.stop(proc)
                raise
            if proc.returncode not in self.accept or not (out / "result.json").is_file():
                raise SideError(self.label, f"the {self.label} side's run exited {proc.returncode}: "
                                            f"{_why(out.with_suffix('.log'), out)}",
                                internal=proc.returncode == EXIT_INTERNAL)
            kept = self._kept()
            if kept is not None and store:
                kept.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(out / "result.json", kept)
        self.outs.append(out)
        return "ran" if proc is not None else "reused"

    @staticmethod
    def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
        """Stop a run that is still going: SIGTERM (it stops its ranks), then SIGKILL."""
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _kept(self) -> Path | None:
        return self.store / f"{len(self.outs)}.json" if self.store else None


def _why(log: Path, out: Path) -> str:
    """What a side's run that failed said: its first failed run's first line, else its output's last lines."""
    import json

    try:
        for s in json.loads((out / "result.json").read_text())["scenarios"]:
            for r in s["runs"]:
                if not r.get("ok") and r.get("failure") and not r.get("expect_error"):
                    return f"{s['name']}/{r['name']}: {r['failure'].splitlines()[0]}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
    except OSError:
        return "no output"


def in_repository(repo: Path, scenario: str) -> str:
    path = Path(scenario).resolve()
    try:
        return str(path.relative_to(repo))
    except ValueError as e:
        raise ScenarioError(f"{scenario}: not inside the git repository {repo}, so it has no version at the "
                            f"revision to compare with") from e


def fast_speeds(docs: list[tuple[Path, dict[str, Any]]]) -> dict[tuple[str, str], list[float]]:
    """Each run's speeds over the documents' repeats, by (scenario, run): its fastest steps'
    (``harness.judge.baselines.fastest_tok_s``), else its median; failed runs left out."""
    from harness.judge.baselines import collect_repeats

    out = {}
    for key, entry in collect_repeats(docs).items():
        if entry["failed"] or not entry["repeats"]:
            continue
        out[key] = [r.get("fastest_tok_s") or r["median_tok_s"] for r in entry["repeats"]]
    return out


def _speeds(outs: list[Path]) -> dict[tuple[str, str], list[float]]:
    return fast_speeds(load_results([str(o) for o in outs]))


def _side_speeds(side: Side) -> dict[tuple[str, str], list[float]]:
    try:
        return _speeds(side.outs)
    except ScenarioError as e:
        raise SideError(side.label, f"the {side.label} side's results cannot be read here: {e}") from e


def run_pairs(sides: list[Side], scenarios: list[str], design: Any, work: Path,
              side_by_side: bool = False) -> dict[tuple[str, str], Any]:
    """Pairs of runs until every run's speed is decided (or ``design.max_pairs``): in turns, the
    order alternating, or both sides at once (``harness.run.sides_at_once``)."""
    from harness.judge.paired import sequential_look
    from harness.run.sides_at_once import halves, run_at_once

    split = halves() if side_by_side else None  # before any run: one CPU is refused in one line
    verdicts: dict[tuple[str, str], Any] = {}
    for k in range(design.max_pairs):
        if side_by_side:
            run_at_once(sides, scenarios, work, k, split)
            print(f"pair {k + 1}/{design.max_pairs}: both sides done, side by side", file=sys.stderr, flush=True)
        else:
            for side in sides if k % 2 == 0 else sides[::-1]:
                how = side.run(scenarios, work / f"{side.label}{k}")
                print(f"pair {k + 1}/{design.max_pairs}: {side.label} {'done' if how == 'ran' else how}",
                      file=sys.stderr, flush=True)
        if k + 1 in design.looks:
            base_speed, cand_speed = (_side_speeds(side) for side in sides)
            keys = sorted(set(base_speed) & set(cand_speed))
            runs = dataclasses.replace(design, runs=len(keys))
            verdicts = {key: sequential_look(base_speed[key], cand_speed[key], runs) for key in keys}
            if all(v.decided for v in verdicts.values()):
                break
    return verdicts


ENVIRONMENT_VARS = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")  # this environment's, not the other's


def interpreter(spec: str) -> str:
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


@dataclass
class PairedRuns:
    """What a paired gate ran: each run's speed verdict, both sides' result documents and
    ``pairs``, how many pairs it took."""

    verdicts: dict[tuple[str, str], Any]
    base_docs: list[tuple[Path, dict[str, Any]]]
    cand_docs: list[tuple[Path, dict[str, Any]]]
    pairs: int
    side_by_side: bool = False


def _paired(sides: list[Side], scenarios: list[str], design: Any, work: Path, side_by_side: bool,
            keep: Path | None) -> PairedRuns:
    if keep is not None:  # the pairs' runs and logs kept (gate --out DIR: DIR/pairs)
        shutil.rmtree(keep, ignore_errors=True)
        keep.mkdir(parents=True)
    verdicts = run_pairs(sides, scenarios, design, keep or work, side_by_side)
    base, cand = (load_results([str(o) for o in side.outs]) for side in sides)
    return PairedRuns(verdicts, base, cand, len(sides[1].outs), side_by_side)


def pairs_against(rev: str, scenarios: list[str], design: Any, options: list[str], side_by_side: bool = False,
                  keep: Path | None = None) -> tuple[PairedRuns, str, str | None]:
    """This checkout against revision ``rev`` in pairs: (the runs, the revision's commit, this
    checkout's revision: +dirty with uncommitted changes); ``options``: more options of ``run``;
    ``keep``: where the pairs' runs are kept (else they go with the gate)."""
    from harness.controller.environment import git_revision

    repo = repository(Path.cwd())
    commit = resolve_revision(rev, repo)
    here = git_revision(repo)
    relative = [in_repository(repo, s) for s in scenarios]
    work = Path(tempfile.mkdtemp(prefix="mlx-ddp-harness-against-"))
    tree = work / "tree"
    try:
        git(["worktree", "add", "--detach", "--quiet", str(tree), commit], repo)
        missing = [s for s in relative if not (tree / s).is_file()]
        if missing:
            raise ScenarioError(f"{missing[0]}: not in revision {rev} ({commit[:12]})")
        sides = [Side("baseline", sys.executable, tree, side_env(tree), options=options),
                 Side("candidate", sys.executable, repo, dict(os.environ), options=options)]
        return _paired(sides, relative, design, work, side_by_side, keep), commit, here
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def pairs_env(python: str, scenarios: list[str], design: Any, options: list[str], side_by_side: bool = False,
              keep: Path | None = None) -> PairedRuns:
    """This environment against the one of interpreter ``python`` in pairs, this checkout's
    ``scenarios`` under each."""
    for s in scenarios:
        if not Path(s).is_file():
            raise ScenarioError(f"{s}: no such scenario file")
    work = Path(tempfile.mkdtemp(prefix="mlx-ddp-harness-env-"))
    try:
        here = Path.cwd()
        own = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT_VARS}  # each Python finds its own
        sides = [Side("baseline", python, here, own, options=options),
                 Side("candidate", sys.executable, here, dict(os.environ), options=options)]
        return _paired(sides, [str(Path(s).resolve()) for s in scenarios], design, work, side_by_side, keep)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class PairedJudgement:
    """A paired gate's gates (speed by the paired verdicts, checks by their verdicts on each side,
    losses and memory against a baseline made of the baseline side's runs), its notes, the runs
    compared (for the regression table) and that baseline."""

    gates: list[Any]
    notes: list[str]
    compared: list[tuple[str, str, dict[str, Any], dict[str, Any]]]
    baseline: dict[str, Any]


def judge_paired(runs: PairedRuns, tol: Any, margin_pct: float) -> PairedJudgement:
    """Judge what a paired gate ran (``margin_pct``: the slowdown that is not a regression)."""
    import statistics

    from harness.judge.baselines import FAST_TOK_S, build_baseline
    from harness.judge.gates import PairedGate, check_gates, gate

    baseline = build_baseline(runs.base_docs, tol)
    gates, notes, compared = gate(baseline, runs.cand_docs, tol)
    gates = [g for g in gates if g.metric != "throughput"]
    base_speed, cand_speed = fast_speeds(runs.base_docs), fast_speeds(runs.cand_docs)
    for key, v in sorted(runs.verdicts.items()):
        gates.append(PairedGate(*key, "throughput (paired)", v.decided == "pass",
                                f"{statistics.median(cand_speed[key]):.1f} {FAST_TOK_S}",
                                f"{statistics.median(base_speed[key]):.1f} {FAST_TOK_S}",
                                f"at most {margin_pct:g}% slower, p >= {v.design.alarm_level:.2g}",
                                v.describe(), inconclusive=v.decided != "pass" and not v.alarm))
        notes.append(f"{key[0]}/{key[1]}: {v.pair_note(runs.side_by_side)}")
    gates.extend(check_gates(runs.base_docs, runs.cand_docs))
    return PairedJudgement(gates, notes, compared, baseline)
