"""``gate --bisect GOOD..BAD SCENARIO...`` and ``gate --bisect-versions PACKAGE==V1..V2
SCENARIO...``: prints each probe as it ends (commit, subject, outcome,
the metric that decided and its figure, the runs it took), then the answer; writes
``--out/bisect.json`` and the GitHub job summary. Exit 1 where a regression was found (one
commit, or a range where commits between could not be tested or decided), 0 where BAD does not
regress against GOOD, 4 where it could not be decided (``harness.run.bisect``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from harness.exit_codes import EXIT_CHECK_FAILED, EXIT_INCONCLUSIVE, EXIT_PASS
from harness.judge.bisection import Answer, Bisection, Commit
from harness.scenario import ScenarioError

EXIT = {"found": EXIT_CHECK_FAILED, "range": EXIT_CHECK_FAILED, "none": EXIT_PASS, "undecided": EXIT_INCONCLUSIVE}
BISECT_FILE = "bisect.json"


def _named(c: Commit) -> str:
    return f'{c.short} "{c.subject}"'


def probe_line(k: int, record: Any, bisection: Bisection) -> str:
    p = record.probe
    role = " (BAD)" if p.index == bisection.last else ""
    return f"probe {k}{role}: {_named(p.commit)}: {p.outcome.upper()} by {p.metric or '-'}: {p.figure}; {p.runs} runs"


def answer_lines(answer: Answer, bisection: Bisection, noun: str = "commit") -> list[str]:
    runs = sum(p.runs for p in bisection.probes)
    took = f"{len(bisection.probes)} probes, {runs} runs"
    if answer.kind == "found":
        deciding = next(p for p in bisection.probes if p.commit == answer.first_bad)
        return [f"first bad {noun}: {_named(answer.first_bad)}",
                f"  {deciding.metric}: {deciding.figure}",
                f"  last good: {_named(answer.last_good)}; {took}"]
    if answer.kind == "range":
        set_aside = {p.commit: p for p in bisection.probes if p.outcome in ("untestable", "undecided")}
        lines = [f"the first bad {noun} is one of {len(answer.candidates)} after {_named(answer.last_good)} "
                 f"({answer.why}; {took}):"]
        for c in answer.candidates:
            p = set_aside.get(c)
            lines.append(f"  {_named(c)}" + (f": {p.outcome}, {p.metric}" if p else ""))
        return lines
    if answer.kind == "none":
        return [f"no regression in the range: {answer.why} ({took})"]
    return [f"could not decide: {answer.why} ({took})"]


def _levels(rec: Any) -> dict[str, float] | None:
    """The false-alarm rate a probe's speed test ran at and the nominal level each run was tested at."""
    verdicts = list(rec.runs.verdicts.values()) if rec is not None and rec.runs is not None else []
    if not verdicts:
        return None
    design = verdicts[0].design
    return {"alpha": design.alpha, "alarm_level": design.alarm_level, "runs": design.runs}


def record(spec: str, answer: Answer, bisection: Bisection, alpha: float, records: list[Any]) -> dict[str, Any]:
    from harness import schema

    def commit(c: Commit | None) -> dict[str, str] | None:
        return {"sha": c.sha, "subject": c.subject} if c else None

    return schema.stamp({
        "kind": "bisect", "range": spec, "alpha": alpha, "max_probes": bisection.budget.probes,
        "answer": {"kind": answer.kind, "first_bad": commit(answer.first_bad), "last_good": commit(answer.last_good),
                   "candidates": [commit(c) for c in answer.candidates], "why": answer.why},
        "exit_code": EXIT[answer.kind],
        "probes": [{"commit": commit(p.commit), "index": p.index, "outcome": p.outcome, "metric": p.metric,
                    "figure": p.figure, "runs": p.runs, "speed_test": _levels(rec)}
                   for p, rec in zip(bisection.probes, records, strict=True)]})


def summary(spec: str, answer: Answer, bisection: Bisection, noun: str) -> str:
    rows = "\n".join(f"| {k} | `{p.commit.short}` {p.commit.subject} | {p.outcome} | {p.metric} | {p.figure} | "
                     f"{p.runs} |" for k, p in enumerate(bisection.probes, 1))
    flag = "--bisect" if noun == "commit" else "--bisect-versions"
    return (f"### gate {flag} {spec}\n\n| Probe | Commit | Outcome | Metric | Figure | Runs |\n"
            f"|---|---|---|---|---|---|\n{rows}\n\n" + "\n".join(answer_lines(answer, bisection, noun)))


def _metrics(args: argparse.Namespace) -> tuple[str, ...]:
    from harness.run.bisect import METRICS

    metrics = tuple(m.strip() for m in (args.metrics or ",".join(METRICS)).split(",") if m.strip())
    unknown = [m for m in metrics if m not in METRICS]
    if unknown or not metrics:
        raise ScenarioError(f"--metrics {args.metrics}: name some of {', '.join(METRICS)}")
    return metrics


def cmd_gate_bisect(args: argparse.Namespace, overrides: dict[str, float | None]) -> int:
    """``gate --bisect GOOD..BAD`` or ``gate --bisect-versions PACKAGE==V1..V2``; ``overrides``:
    the tolerance flags given."""
    from harness.judge.baselines import Tolerances
    from harness.present.paired_gates import pair_mode, run_options, sequential_design
    from harness.run.bisect import Prober, ProbeSettings, ReleaseProber, first_parent_range
    from harness.run.pairs import repository

    if args.baseline or args.against or args.env or (args.bisect and args.bisect_versions):
        raise ScenarioError("--bisect and --bisect-versions run their own sides: give one of them, without "
                            "--baseline, --against or --env")
    out = Path(args.out).resolve() if args.out else None
    metrics = _metrics(args)
    mode = pair_mode(args, speed_judged="speed" in metrics, scenarios=args.results)
    settings = ProbeSettings(sequential_design(args), Tolerances().updated(**overrides), args.slowdown_margin,
                             run_options(args), out, metrics, mode.side_by_side)
    if args.bisect:
        spec, what = args.bisect, "commits after it on the first-parent line"
        repo = repository(Path.cwd(), "--bisect")
        points = first_parent_range(args.bisect, repo)
        prober: Any = Prober(repo, points[0], args.results, settings)
    else:
        from harness.run.release_envs import Requirement, releases

        req = Requirement.parse(args.bisect_versions)
        spec, what = args.bisect_versions, f"releases of {req.package} after it"
        find_links, no_index = list(args.find_links or []), bool(args.no_index)
        points = [Commit(v, f"{req.package} {v}") for v in releases(req, find_links, no_index)]
        prober = ReleaseProber(req, points[0], args.results, settings, find_links, no_index)
    return _bisect_and_report(spec, what, points, prober, args.alpha, settings,
                              "commit" if args.bisect else "release", mode.line())


def _bisect_and_report(spec: str, what: str, points: list[Commit], prober: Any, alpha: float, settings: Any,
                       noun: str, mode: str) -> int:
    import sys

    from harness.judge.bisection import Budget
    from harness.present.report import append_step_summary
    from harness.run.bisect import bisect

    budget = Budget(len(points) - 1, alpha)
    print(f"bisect {spec}: GOOD {_named(points[0])}, {len(points) - 1} {what}; at most {budget.probes} probes, "
          f"each at a false-alarm rate of {budget.per_probe:.2g} ({alpha:g} over the bisection); gated: "
          f"{', '.join(settings.metrics)}; {mode}", flush=True)

    def heard(k: int, rec: Any, bisection: Bisection) -> None:
        print(probe_line(k, rec, bisection), flush=True)
        print(f"probe {k} done", file=sys.stderr, flush=True)

    try:
        bisection, records = bisect(points, prober, budget, heard)
    finally:
        prober.close()
    answer = bisection.answer()
    print("\n".join(answer_lines(answer, bisection, noun)))
    append_step_summary(summary(spec, answer, bisection, noun))
    if settings.out is not None:
        from harness import schema

        settings.out.mkdir(parents=True, exist_ok=True)
        schema.write_json_atomic(settings.out / BISECT_FILE, record(spec, answer, bisection, alpha, records))
    return EXIT[answer.kind]
