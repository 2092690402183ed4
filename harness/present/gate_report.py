"""What ``gate`` and ``baseline update`` print: the seed's single-process regression table,
the gates, and the baseline's entries; and the one record every gate writes (``emit_gate``)."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

from harness import schema
from harness.judge.baselines import Tolerances
from harness.judge.gates import Gate
from harness.present.tables import table

REGRESSION_HEADERS = ["Model / seq", "Scenario", "Hardware", "Branch", "Runtime", "Post-step-1 median tok/s",
                      "Avg loss", "Final loss"]


def hardware(env: dict[str, Any]) -> str:
    """The chip or CPU a result ran on, or the GPU's name when MLX ran on one."""
    device = str(env.get("device", ""))
    if "gpu" in device and "(" in device.split(")", 1)[-1]:
        return device.split(")", 1)[-1].strip(" ()")  # "Device(gpu, 0) (NVIDIA H100 80GB HBM3)"
    return str(env.get("cpu", "?"))


def _revision(label: str, env: dict[str, Any]) -> str:
    rev = env.get("git_revision")
    return f"{label} ({rev})" if rev else label


def regression_rows(compared: list[tuple[str, str, dict[str, Any], dict[str, Any]]], baseline: dict[str, Any],
                    env: dict[str, Any]) -> list[list[Any]]:
    """Single-process runs against the baseline: a baseline row and a current row each."""
    rows = []
    for scenario, _run, base, now in compared:
        if now["world_size"] != 1:
            continue
        for branch, figures, where in (("baseline", base, baseline["environment"]), ("current", now, env)):
            rows.append([figures.get("model") or "-", scenario, hardware(where), _revision(branch, where),
                         f"{figures['runtime_s']:.3f}s", f"{figures['median_tok_s']:.1f}",
                         f"{figures['avg_loss']:.6f}", f"{figures['final_loss']:.6f}"])
    return rows


def gate_table(gates: list[Gate], fmt: str = "plain") -> str:
    rows = [[g.scenario, g.run, g.metric, g.current, g.baseline, g.threshold, g.result, g.detail] for g in gates]
    return table(rows, ["Scenario", "Run", "Metric", "Current", "Baseline", "Threshold", "Result", "Detail"], fmt)


def gate_text(gates: list[Gate], notes: list[str], compared: list, baseline: dict[str, Any],
              env: dict[str, Any], base_name: str, fmt: str = "plain") -> str:
    """The whole gate report: verdict, regression table, gates, failures spelled out, notes."""
    failed = [g for g in gates if not g.passed]
    verdict = f"gate against {base_name}: {'FAILED' if failed else 'PASSED'} ({len(gates) - len(failed)} of " \
              f"{len(gates)} gates passed)"
    parts = [verdict]
    regression = regression_rows(compared, baseline, env)
    if regression:
        title = "Single-process regression against the baseline"
        parts.append(f"{title}\n\n" + table(regression, REGRESSION_HEADERS, fmt))
    parts.append(gate_table(gates, fmt))
    parts.extend(g.message() for g in failed)
    parts.extend(f"note: {n}" for n in notes)
    return "\n\n".join(parts)


def baseline_rows(baseline: dict[str, Any]) -> list[list[Any]]:
    """One row per run; its speed column: the smallest slowdown a gate of one run against the
    whole baseline could detect (``speed_t_test``), or the old band of a baseline without speeds."""
    from harness.judge.gates import speed_t_test

    tol = Tolerances(**baseline["tolerances"])
    entries = [(scenario, run, b) for scenario, runs in baseline["scenarios"].items() for run, b in runs.items()]
    rows = []
    for scenario, run, b in entries:
        fast = b.get("fast_tok_s_repeats")
        if fast:
            speed = f"{speed_t_test(fast, [statistics.median(fast)], len(entries))[3]:.1%}"
        else:
            speed = f"-{tol.slowdown_allowed(b['tok_s_spread']):.1%} allowed (old band)"
        rows.append([scenario, run, b["world_size"], b["repeats"], f"{b['median_tok_s']:.1f}",
                     f"{b['tok_s_spread']:.1%}", speed, f"{tol.loss_allowed(b['loss_spread']):.3g}",
                     f"±{tol.memory_pct:g}%"])
    return rows


def baseline_table(baseline: dict[str, Any], fmt: str = "plain") -> str:
    headers = ["Scenario", "Run", "World size", "Repeats", "Median tok/s", "Repeat spread",
               "Slowdown detectable (1 run)", "Loss tolerance", "Memory"]
    return table(baseline_rows(baseline), headers, fmt)


GATE_FILE = "gate.json"


def gate_record(gates: list[Gate], notes: list[str], base_name: str, env: dict[str, Any]) -> dict[str, Any]:
    """Every gate (speed, loss, memory, a run that failed) in the same fields, for a CI job to read."""
    return schema.stamp({"kind": "gate", "against": base_name, "passed": all(g.passed for g in gates),
                         "environment": env, "notes": notes,
                         "gates": [{**dataclasses.asdict(g), "result": g.result} for g in gates]})


def emit_gate(gates: list[Gate], notes: list[str], compared: list, baseline: dict[str, Any], env: dict[str, Any],
              base_name: str, fmt: str, out: str | None) -> None:
    """Print the gate report, append it to the GitHub job summary (where one is kept) and, with
    ``out``, write ``out/gate.json``."""
    from harness.present.report import append_step_summary

    print(gate_text(gates, notes, compared, baseline, env, base_name, fmt))
    append_step_summary(gate_text(gates, notes, compared, baseline, env, base_name, "github"))
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        schema.write_json_atomic(Path(out) / GATE_FILE, gate_record(gates, notes, base_name, env))
