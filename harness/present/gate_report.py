"""What ``gate`` and ``baseline update`` print: the seed's single-process regression table,
the gates, and the baseline's entries; and the one record every gate writes (``emit_gate``).

A gate's verdict is PASSED, FAILED (a gate failed) or INCONCLUSIVE (none failed, but a paired
speed test ran out of pairs with neither hypothesis rejected, or a check failed in some of the
candidate's runs only or was not judged there: ``harness.judge.gates.PairedGate``), each with its
exit code."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

from harness import schema
from harness.exit_codes import EXIT_CHECK_FAILED, EXIT_INCONCLUSIVE, EXIT_PASS
from harness.judge.baselines import FAST_TOK_S, Tolerances, entry_environment  # noqa: F401 (FAST_TOK_S: read from here too)
from harness.judge.gates import INCONCLUSIVE, Gate, PairedGate
from harness.present.tables import TOK_S_HEADER, table

REGRESSION_HEADERS = ["Model / seq", "Scenario", "Run", "Hardware", "Revision", "Runtime", TOK_S_HEADER,
                      f"Gated speed: {FAST_TOK_S}", "Avg loss", "Final loss"]  # TOK_S_HEADER: the run tables'


def verdict(gates: list[Gate]) -> str:
    """FAILED when a gate failed, else INCONCLUSIVE when one was undecided, else PASSED."""
    results = {g.result for g in gates}
    return "FAILED" if "FAIL" in results else INCONCLUSIVE if INCONCLUSIVE in results else "PASSED"


def exit_code(gates: list[Gate]) -> int:
    """``gate``'s exit code for its verdict."""
    return {"FAILED": EXIT_CHECK_FAILED, INCONCLUSIVE: EXIT_INCONCLUSIVE, "PASSED": EXIT_PASS}[verdict(gates)]


def hardware(env: dict[str, Any]) -> str:
    """The chip or CPU a result ran on, or the GPU's name when MLX ran on one."""
    device = str(env.get("device", ""))
    if "gpu" in device and "(" in device.split(")", 1)[-1]:
        return device.split(")", 1)[-1].strip(" ()")  # "Device(gpu, 0) (NVIDIA H100 80GB HBM3)"
    return str(env.get("cpu", "?"))


def _same_commit(a: str, b: str) -> bool:
    """Two revisions (short or long hashes, ``+dirty`` or not) of one commit and state."""
    (ha, _, da), (hb, _, db) = a.partition("+"), b.partition("+")
    return da == db and (ha.startswith(hb) or hb.startswith(ha))


def revision_label(label: str, env: dict[str, Any], repo_rev: str | None = None) -> str:
    """A side's revisions: ``repo_rev``, the gated repository's (when known), and the harness's
    (``env``'s), shown when it differs from the repository's."""
    harness = env.get("git_revision") or (f"v{env['harness_version']}" if env.get("harness_version") else None)
    if repo_rev is None:
        return f"{label} (harness {harness})" if harness else label
    if harness is None or _same_commit(repo_rev, harness):
        return f"{label} ({repo_rev})"
    return f"{label} ({repo_rev}; harness {harness})"


Sides = tuple[tuple[str, str | None], tuple[str, str | None]]  # (label, repository revision) of each side
DEFAULT_SIDES: Sides = (("baseline", None), ("current", None))


def add_fast_speeds(compared: list[tuple[str, str, dict[str, Any], dict[str, Any]]],
                    docs: list[tuple[Path, dict[str, Any]]]) -> None:
    """Put each compared run's gated speed (the median over its repeats of ``fastest_tok_s``) into its
    current figures, for the regression table."""
    from harness.judge.baselines import collect_repeats

    pooled = collect_repeats(docs)
    for scenario, run, _base, now in compared:
        fast = [r.get("fastest_tok_s") for r in pooled.get((scenario, run), {}).get("repeats", [])]
        if fast and None not in fast:
            now["fastest_tok_s"] = statistics.median(fast)


def _fast(figures: dict[str, Any]) -> str:
    fast = figures.get("fastest_tok_s") or statistics.median(figures.get("fastest_tok_s_repeats") or [0.0])
    return f"{fast:.1f}" if fast else "-"


def regression_rows(compared: list[tuple[str, str, dict[str, Any], dict[str, Any]]], baseline: dict[str, Any],
                    env: dict[str, Any], sides: Sides = DEFAULT_SIDES) -> list[list[Any]]:
    """Single-process runs against the baseline: a baseline row and a current row each."""
    rows = []
    for scenario, run, base, now in compared:
        if now["world_size"] != 1:
            continue
        for (label, repo_rev), figures, where in ((sides[0], base, entry_environment(baseline, base)),
                                                  (sides[1], now, env)):
            rows.append([figures.get("model") or "-", scenario, run, hardware(where),
                         revision_label(label, where, repo_rev), f"{figures['runtime_s']:.3f}s",
                         f"{figures['median_tok_s']:.1f}", _fast(figures), f"{figures['avg_loss']:.6f}",
                         f"{figures['final_loss']:.6f}"])
    return rows


def gate_table(gates: list[Gate], fmt: str = "plain") -> str:
    rows = [[g.scenario, g.run, g.metric, g.current, g.baseline, g.threshold, g.result, g.detail] for g in gates]
    return table(rows, ["Scenario", "Run", "Metric", "Current", "Baseline", "Threshold", "Result", "Detail"], fmt)


SPEED_UNDECIDED = ("INCONCLUSIVE is neither a pass nor a failure: the pairs allowed could not tell the speeds "
                   "apart from the noise (the interval above); rerun with a larger --pairs to decide (on a shared "
                   "CPU machine whose pairs ran in turns, side by side: docs/reports.md#side-by-side)")
CHECKS_UNDECIDED = ("INCONCLUSIVE checks failed in some of the candidate's runs and passed in others: a flaky "
                    "check or a defect that shows only at times; neither a pass nor a failure (more pairs will not "
                    "settle it: run the scenario with --repeat to see how often it fails)")
CHECKS_UNJUDGED = ("INCONCLUSIVE checks passed at the baseline and the candidate did not judge them (n/a, or "
                   "without the power to see a defect: each one's detail says why): whether they still hold is not "
                   "known; neither a pass nor a failure, and more pairs or repeats will not settle it: find what "
                   "stopped them deciding (what the trainer no longer reports, the scenario, the precision)")


def undecided_advice(gates: list[Gate]) -> list[str]:
    """What to do about each kind of gate that could not decide."""
    open_ = [g for g in gates if isinstance(g, PairedGate) and g.inconclusive]
    kinds = {"speed" for g in open_ if g.metric != "checks"}
    kinds |= {"flaky" for g in open_ if g.flaky} | {"unjudged" for g in open_ if g.unjudged}
    return [text for kind, text in (("speed", SPEED_UNDECIDED), ("flaky", CHECKS_UNDECIDED),
                                    ("unjudged", CHECKS_UNJUDGED)) if kind in kinds]


def gate_text(gates: list[Gate], notes: list[str], compared: list, baseline: dict[str, Any],
              env: dict[str, Any], base_name: str, fmt: str = "plain", sides: Sides = DEFAULT_SIDES) -> str:
    """The whole gate report: verdict, regression table, gates, failures and undecided gates
    spelled out, notes."""
    failed = [g for g in gates if g.result != "pass"]
    undecided = sum(g.result == INCONCLUSIVE for g in gates)
    head = f"gate against {base_name}: {verdict(gates)} ({sum(g.passed for g in gates)} of {len(gates)} gates " \
           f"passed{f', {undecided} inconclusive' if undecided else ''})"
    parts = [head]
    regression = regression_rows(compared, baseline, env, sides)
    if regression:
        title = "Single-process regression against the baseline"
        parts.append(f"{title}\n\n" + table(regression, REGRESSION_HEADERS, fmt))
    parts.append(gate_table(gates, fmt))
    parts.extend(g.message() for g in failed)
    parts.extend(undecided_advice(gates))
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
        fast = b.get("fastest_tok_s_repeats")
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
    """Every gate (speed, loss, memory, a run that failed) in the same fields, for a CI job to read;
    ``verdict`` and ``exit_code`` as ``gate`` ends (``passed``: every gate passed)."""
    fields = [f.name for f in dataclasses.fields(Gate)]
    return schema.stamp({"kind": "gate", "against": base_name, "passed": verdict(gates) == "PASSED",
                         "verdict": verdict(gates).lower(), "exit_code": exit_code(gates),
                         "environment": env, "notes": notes,
                         "gates": [{**{k: getattr(g, k) for k in fields}, "result": g.result} for g in gates]})


def emit_gate(gates: list[Gate], notes: list[str], compared: list, baseline: dict[str, Any], env: dict[str, Any],
              base_name: str, fmt: str, out: str | None, sides: Sides = DEFAULT_SIDES) -> None:
    """Print the gate report, append it to the GitHub job summary (where one is kept) and, with
    ``out``, write ``out/gate.json``."""
    from harness.present.report import append_step_summary

    print(gate_text(gates, notes, compared, baseline, env, base_name, fmt, sides))
    append_step_summary(gate_text(gates, notes, compared, baseline, env, base_name, "github", sides))
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        schema.write_json_atomic(Path(out) / GATE_FILE, gate_record(gates, notes, base_name, env))
