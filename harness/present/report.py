"""Write ``result.json`` and ``report.md`` into the output directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness import schema
from harness.present.tables import checks_table, failures, parity_table, resume_rows, resume_table


def markdown(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    lines = ["# mlx-ddp-harness report", "",
             f"Overall: **{'PASSED' if doc['passed'] else 'FAILED'}** (exit code {doc['exit_code']})", "",
             "## Environment", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    for s in doc["scenarios"]:
        lines += ["", f"## {s['name']}: {s['status']}", ""]
        if s["description"]:
            lines += [s["description"], ""]
        lines += ["### DDP parity at equal global batch", "", parity_table(s, "github"), ""]
        if resume_rows(s):
            lines += ["### Resume", "", resume_table(s, "github"), ""]
        if s["checks"]:
            lines += ["### Checks", "", checks_table(s, "github"), ""]
        for f in failures(s):
            lines += ["```", f, "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_outputs(out: Path, doc: dict[str, Any]) -> list[Path]:
    """``out/result.json`` and ``out/report.md``, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    result = out / "result.json"
    schema.write_json_atomic(result, doc)
    report = out / "report.md"
    tmp = report.with_name(".report.md.tmp")
    tmp.write_text(markdown(doc))
    os.replace(tmp, report)
    return [result, report]
