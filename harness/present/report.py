"""Write ``report.md`` (and ``result.json`` beside it) into the output directory; the closing
lines of ``run``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness.present.tables import (
    checks_table,
    failures,
    floor_notes,
    mutation_rows,
    mutation_table,
    repeat_rows,
    repeat_table,
    resume_rows,
    resume_table,
    runs_table,
    runs_title,
)
from harness.run.results import write_result

OVERALL = {0: "PASSED", 4: "INCONCLUSIVE"}  # by exit code; every other one is a failure


def markdown(doc: dict[str, Any], plots: dict[str, list[tuple[str, Path]]] | None = None) -> str:
    """The report: environment, then per scenario its tables and (when written) its plots."""
    env = doc["environment"]
    lines = ["# mlx-ddp-harness report", "",
             f"Overall: **{OVERALL.get(doc['exit_code'], 'FAILED')}** (exit code {doc['exit_code']})", "",
             "## Environment", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    for s in doc["scenarios"]:
        lines += ["", f"## {s['name']}: {s['status']}", ""]
        if s["description"]:
            lines += [s["description"], ""]
        lines += [f"### {runs_title(s)}", "", runs_table(s, "github"), ""]
        lines += [f"- {note}" for note in floor_notes(s)] + ([""] if floor_notes(s) else [])
        if mutation_rows(s):
            lines += ["### Injected DDP bugs", "", mutation_table(s, "github"), ""]
        if repeat_rows(s):
            lines += [f"### Repeat-to-repeat spread ({s['repeats']} repeats)", "", repeat_table(s, "github"), ""]
        if resume_rows(s):
            lines += ["### Resume", "", resume_table(s, "github"), ""]
        if s["checks"]:
            lines += ["### Checks", "", checks_table(s, "github"), ""]
        for f in failures(s):
            lines += ["```", f, "```", ""]
        for caption, rel in (plots or {}).get(s["name"], []):
            lines += [f"![{s['name']}: {caption}]({rel.as_posix()})", ""]
    return "\n".join(lines).rstrip() + "\n"


def append_step_summary(text: str) -> None:
    """Append markdown to the GitHub Actions job summary when ``GITHUB_STEP_SUMMARY`` names one."""
    target = os.environ.get("GITHUB_STEP_SUMMARY")
    if target:
        with open(target, "a", encoding="utf-8") as f:
            f.write(text.rstrip() + "\n\n")


PLOTS_VAR = "MLX_DDP_HARNESS_PLOTS"  # off (or 0, no, false): reports without plots, as --no-plots


def plots_wanted() -> bool:
    """Whether reports carry plots unless a command says otherwise (``PLOTS_VAR``)."""
    return os.environ.get(PLOTS_VAR, "on").strip().lower() not in ("off", "0", "no", "false")


def write_outputs(out: Path, doc: dict[str, Any], plots: bool | None = None) -> list[Path]:
    """``out/result.json`` (``harness.run.results.write_result``) and its report
    (``write_report``)."""
    return [write_result(out, doc), *write_report(out, doc, plots)]


def write_report(out: Path, doc: dict[str, Any], plots: bool | None = None) -> list[Path]:
    """The plots under ``out/plots`` (unless ``plots`` is False; None: ``plots_wanted()``) and
    ``out/report.md`` (written atomically); with ``GITHUB_STEP_SUMMARY`` set, the report's tables
    go to the job summary too. Drawing the plots is most of a small run's cost in the controller
    (about 1 CPU-s for a scenario's four)."""
    out.mkdir(parents=True, exist_ok=True)
    if plots is None:
        plots = plots_wanted()
    if plots:
        from harness.present.plots import write_plots

        drawn = {s["name"]: write_plots(out, s) for s in doc["scenarios"]}
    else:
        drawn = {}
    report = out / "report.md"
    tmp = report.with_name(".report.md.tmp")
    tmp.write_text(markdown(doc, drawn))
    os.replace(tmp, report)
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        append_step_summary(markdown(doc))  # the job summary cannot show local images
    return [report, *(out / rel for p in drawn.values() for _, rel in p)]


def summary_lines(doc: dict[str, Any], out: Path | None) -> list[str]:
    """The closing block of ``run``: the scenarios by status, the checks by outcome, what this
    machine skipped and where the report went."""
    from collections import Counter

    status = Counter(s["status"] for s in doc["scenarios"])
    outcomes = Counter(c["result"] for s in doc["scenarios"] for c in s["checks"])
    names = {"pass": "passed", "caught": "mutations caught", "xfail": "expected failures shown", "n/a": "n/a",
             "FAIL": "FAILED", "XPASS": "XPASS (expected failure gone)", "inconclusive": "inconclusive",
             "INCONCLUSIVE": "INCONCLUSIVE (no power)"}
    checks = ", ".join(f"{outcomes[k]} {v}" for k, v in names.items() if outcomes[k])
    scenarios = len(doc["scenarios"])
    lines = [f"summary: {scenarios} scenario{'s' if scenarios != 1 else ''}: {status['passed']} passed, "
             f"{status['failed']} failed, "
             + (f"{status['inconclusive']} inconclusive, " if status["inconclusive"] else "")
             + f"{status['error']} with a run that did not complete; "
             f"checks: {checks or 'none'}; exit {doc['exit_code']}"]
    for sc in doc["scenarios"]:
        planted = {m["run"] for m in sc.get("mutations") or []}  # judged as caught or not, as the status judges them
        for c in sc["checks"]:
            if c["result"] == "INCONCLUSIVE" and c["run"] not in planted:
                lines.append(f"inconclusive: {sc['name']}: {c['name']} ({c['run']}): {c['detail'].split('; vs ')[0]}")
    skipped = doc.get("skipped") or []
    if skipped:
        what = [s["scenario"] + ("" if s["whole"] else " (some runs)") for s in skipped]
        lines.append(f"skipped here: {', '.join(what)}")
    lines.append(f"report: {out / 'report.md'}" if out is not None else "report: none written (run with --out DIR)")
    return lines
