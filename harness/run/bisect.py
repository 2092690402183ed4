"""``gate --bisect GOOD..BAD``: the first commit between two revisions at which a gated metric
regresses. Every probe is a paired gate of GOOD against one commit, each in its own temporary
worktree and run a pair at a time as ``gate --against`` runs them (``harness.run.pairs``), GOOD's side
rerun at every probe; the bookkeeping (which commit next, the false-alarm budget, the answer)
is ``harness.judge.bisection``. A probe's runs are kept under ``--out`` where one is given, and
each commit's or release's own results (``result.json``, never GOOD's) in the cache
(``result_store``): probed again in another bisection, it reuses them pair by pair and runs only
the pairs it lacks, GOOD's side running afresh in every pair."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.judge.bisection import BAD, GOOD, UNDECIDED, UNTESTABLE, Bisection, Budget, Commit, Probe
from harness.judge.gates import PairedGate
from harness.run.pairs import (
    PairedJudgement,
    PairedRuns,
    Side,
    SideError,
    git,
    in_repository,
    judge_paired,
    resolve_revision,
    run_pairs,
    side_env,
)
from harness.scenario import ScenarioError

RUN_WRITTEN = (0, 1, 3, 4)  # exit codes of a run that still wrote its result.json


def first_parent_range(spec: str, repo: Path) -> list[Commit]:
    """``GOOD..BAD`` (``GOOD..``: BAD is HEAD) as GOOD and the commits of BAD's first-parent line
    after it, in order; a one-line error where GOOD is not on that line or nothing follows it."""
    good, sep, bad = spec.partition("..")
    if not sep or not good:
        raise ScenarioError(f"--bisect {spec}: give GOOD..BAD (or GOOD.. for GOOD..HEAD)")
    bad = bad or "HEAD"
    shas = []
    for rev in (good, bad):
        try:
            shas.append(resolve_revision(rev, repo))
        except ScenarioError as e:
            raise ScenarioError(f"--bisect {spec}: {e}") from e
    line = git(["rev-list", "--first-parent", "--reverse", f"{shas[0]}..{shas[1]}"], repo).split()
    if not line:
        raise ScenarioError(f"--bisect {spec}: no commit after {good} on {bad}'s first-parent line")
    if git(["rev-list", "--parents", "-n", "1", line[0]], repo).split()[1:2] != [shas[0]]:
        raise ScenarioError(f"--bisect {spec}: {good} is not on {bad}'s first-parent line (bisect from a commit "
                            f"of it: git log --first-parent {bad})")
    subjects = git(["log", "--no-walk=unsorted", "--format=%H%x00%s", shas[0], *line], repo).splitlines()
    named = dict(entry.split("\0", 1) for entry in subjects if "\0" in entry)
    return [Commit(sha, named.get(sha, "")) for sha in [shas[0], *line]]


@dataclass
class ProbeRecord:
    """A probe and, where it ran, what its paired gate judged."""

    probe: Probe
    judged: PairedJudgement | None = None
    runs: PairedRuns | None = None


METRICS = {"checks": ("checks",), "loss": ("loss",), "memory": ("peak MLX memory", "peak RSS"),
           "speed": ("throughput (paired)",)}  # --metrics: the gates' metrics each name covers


def decide(judged: PairedJudgement, metrics: tuple[str, ...] = tuple(METRICS)) -> tuple[str, str, str]:
    """A probe's outcome from its gates of ``metrics`` (and a run that failed, whatever they are):
    bad where one failed (the first, by metric: a run that failed, a check, the loss, memory,
    then speed), undecided where one could not decide or none was judged, else good; with the
    deciding gate's metric and figure. Checks the commit does not judge (``PairedGate.unjudged``)
    decide nothing: the same at every later commit, they would leave the rest of the range
    undecided; a good probe names them."""
    order = ["run", *(m for name in METRICS if name in metrics for m in METRICS[name])]
    unjudged = [g for g in judged.gates if isinstance(g, PairedGate) and g.metric == "checks" and g.metric in order
                and g.inconclusive and not g.flaky]  # inconclusive only for what it did not judge
    ranked = sorted((g for g in judged.gates if g.metric in order and g not in unjudged),
                    key=lambda g: order.index(g.metric))
    for outcome, result in ((BAD, "FAIL"), (UNDECIDED, "INCONCLUSIVE")):
        g = next((g for g in ranked if g.result == result), None)
        if g is not None:
            detail = f"; {g.detail}" if g.detail else ""
            return outcome, f"{g.metric} {g.scenario}/{g.run}", f"{g.current} vs {g.baseline}{detail}"
    if not ranked:
        return UNDECIDED, "no gate", f"none of {', '.join(metrics)} could be judged on both sides"
    speed = next((g for g in ranked if g.metric == "throughput (paired)"), None)
    aside = "".join(f"; not judged at this commit, {g.scenario}/{g.run}: {g.detail}" for g in unjudged)
    if speed is None:
        return GOOD, "every gate", f"{len(ranked)} gates pass{aside}"
    return (GOOD, f"{speed.metric} {speed.scenario}/{speed.run}",
            f"{speed.current} vs {speed.baseline}; {speed.detail}{aside}")


@dataclass(frozen=True)
class ProbeSettings:
    """What every probe of a bisection shares: the sequential design (its ``alpha`` replaced per
    probe), the tolerances, the slowdown margin in %, more options of ``run``, ``--out``, the
    metrics that make a probe bad and whether a pair's sides run at once (then a commit's kept
    results are not reused: they were not measured beside this GOOD run)."""

    design: Any
    tol: Any
    margin_pct: float
    options: list[str]
    out: Path | None
    metrics: tuple[str, ...]
    side_by_side: bool = False


def result_store(point: Commit, scenarios: list[str], options: list[str], tree: Path | None = None) -> Path:
    """Where a commit's or a release's own results are kept, to be reused when it is probed again
    (in another bisection): by its name, what its scenario files hold, and the options of ``run``.
    GOOD's are never kept: it runs afresh at every probe."""
    import hashlib
    import json

    from harness.controller.inputs import cache_dir

    texts = [(s, Path(tree / s if tree else s).read_text()) for s in scenarios]
    key = hashlib.sha256(json.dumps([point.sha, texts, options]).encode()).hexdigest()[:16]
    return cache_dir() / "bisect-results" / f"{point.short}-{key}"


def _drop_worktree(repo: Path, tree: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, capture_output=True)
    shutil.rmtree(tree, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=repo, capture_output=True)


class Prober:
    """Runs probes: GOOD's worktree kept for the whole bisection, each commit's made and removed."""

    def __init__(self, repo: Path, good: Commit, scenarios: list[str], settings: ProbeSettings):
        self.repo, self.settings = repo, settings
        self.relative = [in_repository(repo, s) for s in scenarios]
        self.work = Path(tempfile.mkdtemp(prefix="mlx-ddp-harness-bisect-"))
        self.good_tree = self.work / "good"
        try:
            git(["worktree", "add", "--detach", "--quiet", str(self.good_tree), good.sha], repo)
            missing = [s for s in self.relative if not (self.good_tree / s).is_file()]
            if missing:
                raise ScenarioError(f"{missing[0]}: not in GOOD ({good.short}): a bisection runs the scenarios at "
                                    f"both ends")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        _drop_worktree(self.repo, self.good_tree)
        shutil.rmtree(self.work, ignore_errors=True)

    def probe(self, k: int, index: int, commit: Commit, alpha: float) -> ProbeRecord:
        """Probe ``commit`` (``k``: the probe's number) at false-alarm rate ``alpha``."""
        tree = self.work / f"c{k}"
        try:
            try:
                git(["worktree", "add", "--detach", "--quiet", str(tree), commit.sha], self.repo)
            except ScenarioError as e:
                return ProbeRecord(Probe(index, commit, UNTESTABLE, f"it cannot be checked out: {e}"))
            missing = [s for s in self.relative if not (tree / s).is_file()]
            if missing:
                return ProbeRecord(Probe(index, commit, UNTESTABLE, f"{missing[0]} is not in this commit"))
            options = self.settings.options
            sides = [Side("baseline", sys.executable, self.good_tree, side_env(self.good_tree), options=options),
                     Side("candidate", sys.executable, tree, side_env(tree), options=options,
                          accept=RUN_WRITTEN, store=result_store(commit, self.relative, options, tree))]
            return paired_probe(self.settings, self.work, k, index, commit, sides, self.relative, alpha)
        finally:
            _drop_worktree(self.repo, tree)


class ReleaseProber:
    """Runs probes of one package's releases: GOOD's environment against each release's (both
    built once, ``harness.run.release_envs``), this checkout's scenarios under each."""

    def __init__(self, req: Any, good: Commit, scenarios: list[str], settings: ProbeSettings, find_links: list[str],
                 no_index: bool):
        from harness.run.pairs import ENVIRONMENT_VARS

        self.req, self.settings, self.find_links, self.no_index = req, settings, find_links, no_index
        missing = [s for s in scenarios if not Path(s).is_file()]
        if missing:
            raise ScenarioError(f"{missing[0]}: no such scenario file")
        self.scenarios = [str(Path(s).resolve()) for s in scenarios]
        self.work = Path(tempfile.mkdtemp(prefix="mlx-ddp-harness-bisect-"))
        self.env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT_VARS}  # each Python finds its own
        try:
            self.good_python = self.python(good)
            if isinstance(self.good_python, str):
                raise ScenarioError(f"{req.package} {good.sha} (GOOD): no environment could be built: "
                                    f"{self.good_python}")
        except BaseException:
            self.close()
            raise

    def python(self, release: Commit) -> Path | str:
        """The environment's interpreter, or why it could not be built."""
        from harness.run.release_envs import environment

        python, said = environment(self.req, release.sha, self.find_links, self.no_index)
        print(f"{self.req.package} {release.sha}: environment {said}", file=sys.stderr, flush=True)
        return python if python is not None else said

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)

    def probe(self, k: int, index: int, release: Commit, alpha: float) -> ProbeRecord:
        python = self.python(release)
        if isinstance(python, str):
            return ProbeRecord(Probe(index, release, UNTESTABLE, f"no environment: {python}"))
        here = Path.cwd()
        # a run that does not complete on the release sets it aside, named (the harness may not run on
        # that release), never taken for the bad one
        options = self.settings.options
        store = result_store(release, self.scenarios, [self.req.name, *options])
        sides = [Side("baseline", str(self.good_python), here, self.env, options=options),
                 Side("candidate", str(python), here, self.env, options=options, store=store)]
        return paired_probe(self.settings, self.work, k, index, release, sides, self.scenarios, alpha)


def paired_probe(settings: ProbeSettings, work: Path, k: int, index: int, point: Commit, sides: list[Side],
                 scenarios: list[str], alpha: float) -> ProbeRecord:
    """Probe ``point``'s side against GOOD's at false-alarm rate ``alpha``: pairs until the speed
    is decided, then every gate; a candidate whose run fails to write a readable result is
    untestable, a GOOD side that does so stops the bisection."""
    where = (settings.out / "probes" / f"{k:02d}-{point.short}") if settings.out else work / f"runs{k}"
    where.mkdir(parents=True, exist_ok=True)
    design = dataclasses.replace(settings.design, alpha=alpha)
    try:
        verdicts = run_pairs(sides, scenarios, design, where, settings.side_by_side)
        base, cand = (_results(side) for side in sides)
    except SideError as e:
        if e.label == "baseline":
            raise ScenarioError(f"GOOD did not run (in the probe of {point.subject}): {e}") from e
        return ProbeRecord(Probe(index, point, UNTESTABLE, str(e), runs=_runs(sides)))
    runs = PairedRuns(verdicts, base, cand, len(sides[1].outs), settings.side_by_side)
    from harness.judge.baselines import BaselineError

    try:
        judged = judge_paired(runs, settings.tol, settings.margin_pct)
    except (BaselineError, KeyError, TypeError, ValueError) as e:  # runs renamed, another precision, older fields
        return ProbeRecord(Probe(index, point, UNTESTABLE, f"its results cannot be judged against GOOD's: {e}",
                                 runs=_runs(sides)), runs=runs)
    outcome, metric, figure = decide(judged, settings.metrics)
    return ProbeRecord(Probe(index, point, outcome, metric, figure, _runs(sides)), judged, runs)


def _results(side: Side) -> list[tuple[Path, dict[str, Any]]]:
    from harness.run.results import load_results

    try:
        return load_results([str(o) for o in side.outs])
    except ScenarioError as e:
        raise SideError(side.label, f"the {side.label} side's results cannot be read here: {e}") from e


def _runs(sides: list[Side]) -> int:
    return sum(len(s.outs) for s in sides)


def good_fails(record: ProbeRecord) -> str | None:
    """Where GOOD's own checks fail (in the first probe's baseline side): which, in one line."""
    if record.runs is None:
        return None
    failed = sorted({f"{s['name']}/{c['run']}: {c['name']}" for _, doc in record.runs.base_docs
                     for s in doc["scenarios"] for c in s.get("checks", []) if c["result"] == "FAIL"})
    return ", ".join(failed[:5]) + (f" and {len(failed) - 5} more" if len(failed) > 5 else "") if failed else None


def bisect(commits: list[Commit], prober: Prober | ReleaseProber, budget: Budget,
           on_probe: Callable[[int, ProbeRecord, Bisection], None]) -> tuple[Bisection, list[ProbeRecord]]:
    """Probe until the bisection is over; ``on_probe`` hears of each probe as it ends."""
    bisection = Bisection(commits, budget)
    records: list[ProbeRecord] = []
    while (index := bisection.next_index()) is not None:
        k = len(records) + 1
        record = prober.probe(k, index, commits[index], bisection.budget.per_probe)
        if k == 1 and "checks" in prober.settings.metrics and (failing := good_fails(record)):
            raise ScenarioError(f"GOOD ({commits[0].short}) fails its own checks ({failing}): a bisection looks "
                                f"for the first commit after a passing one")
        records.append(record)
        bisection.record(record.probe)
        on_probe(k, record, bisection)
    return bisection, records
