"""Regression gates: a result's runs against a baseline of the same platform.

Each gate names its metric, the current and baseline values and the threshold it was held to,
so a failure reads as a complete sentence in CI logs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.judge.baselines import (
    BaselineError,
    Tolerances,
    collect_repeats,
    median_per_rank,
    platform_differences,
    platform_key,
    platform_label,
)
from harness.memory.plan import MB


@dataclass
class Gate:
    """One gated metric of one run."""

    scenario: str
    run: str
    metric: str
    passed: bool
    current: str
    baseline: str
    threshold: str
    detail: str = ""

    @property
    def result(self) -> str:
        return "pass" if self.passed else "FAIL"

    def message(self) -> str:
        head = f"{self.result} {self.scenario}/{self.run} {self.metric}: {self.current} vs baseline {self.baseline}"
        return f"{head} (threshold {self.threshold}){'; ' + self.detail if self.detail else ''}"


INCONCLUSIVE = "INCONCLUSIVE"


@dataclass
class PairedGate(Gate):
    """A gate of two sides run pair by pair; ``inconclusive``: it could not decide (a paired speed
    test out of pairs with neither hypothesis rejected; checks that failed in some of the
    candidate's runs only, ``flaky``, or that it did not judge, ``unjudged``), so it neither
    passed nor failed."""

    inconclusive: bool = False
    flaky: tuple[str, ...] = ()  # checks that failed in some of the candidate's runs only
    unjudged: tuple[str, ...] = ()  # checks that passed at the baseline and that the candidate did not judge

    @property
    def result(self) -> str:
        return INCONCLUSIVE if self.inconclusive else super().result


def _check_results(docs: list[tuple[Path, dict[str, Any]]]) -> dict[tuple[str, str], dict[str, list[dict]]]:
    """Each (scenario, run)'s checks, each with its entry in every document, in order."""
    out: dict[tuple[str, str], dict[str, list[dict]]] = {}
    for _, doc in docs:
        for s in doc["scenarios"]:
            for c in s.get("checks", []):
                out.setdefault((s["name"], c["run"]), {}).setdefault(c["name"], []).append(c)
    return out


def _figure(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def check_gates(base_docs: list[tuple[Path, dict[str, Any]]],
                cand_docs: list[tuple[Path, dict[str, Any]]]) -> list[PairedGate]:
    """Per run both sides ran, its checks' verdicts: FAIL where a check that passed in every run
    of the baseline fails in every run of the candidate; INCONCLUSIVE where it fails in some of
    them only, or where the candidate did not judge it in a run (n/a, INCONCLUSIVE, or an
    expected failure's result there: a check that stops deciding cannot be said to hold). Checks
    that did not pass at the baseline, or that the candidate's plan does not hold, are not gated."""
    base, cand = _check_results(base_docs), _check_results(cand_docs)
    gates = []
    for key in sorted(set(base) & set(cand)):
        held = [n for n, cs in base[key].items() if all(c["result"] == "pass" for c in cs) and n in cand[key]]
        if not held:
            continue
        failing = {n: [c for c in cand[key][n] if c["result"] == "FAIL"] for n in held}
        flipped = [n for n in held if failing[n] and len(failing[n]) == len(cand[key][n])]
        mixed = [n for n in held if failing[n] and n not in flipped]
        unjudged = {n: [c for c in cand[key][n] if c["result"] not in ("pass", "FAIL")] for n in held}
        unjudged = {n: cs for n, cs in unjudged.items() if cs and not failing[n]}
        said = [f"{n}: {_figure(failing[n][0].get('value'))} against limit {_figure(failing[n][0].get('limit'))}"
                + (f" ({len(failing[n])} of {len(cand[key][n])} runs)" if n in mixed else "")
                for n in flipped + mixed]
        said += [_unjudged(n, cs, len(cand[key][n])) for n, cs in unjudged.items()]
        gates.append(PairedGate(*key, "checks", not (flipped or mixed or unjudged),
                                f"{len(flipped) + len(mixed)} of {len(held)} fail"
                                + (f", {len(unjudged)} not judged" if unjudged else ""), f"{len(held)} pass",
                                "every check that passes at the baseline passes",
                                "; ".join(said), inconclusive=bool(mixed or unjudged) and not flipped,
                                flaky=tuple(mixed), unjudged=tuple(unjudged)))
    return gates


def _unjudged(name: str, checks: list[dict[str, Any]], runs: int) -> str:
    """A check that passed at the baseline as the candidate left it: its results there (n/a,
    INCONCLUSIVE, an expected failure's), in how many runs, and the first reason given."""
    results = "/".join(sorted({c["result"] for c in checks}))
    why = next((c["detail"] for c in checks if c.get("detail")), "")
    said = f"{name}: passed at the baseline, {results} here ({len(checks)} of {runs} runs)"
    return f"{said}: {why}" if why else said


def check_platform(baseline: dict[str, Any], base_file: Path, doc: dict[str, Any], result_file: Path,
                   force: bool) -> list[str]:
    """Refuse a result from another platform (``BaselineError``), or with ``force`` say how it differs."""
    current = platform_key(doc["environment"])
    diff = platform_differences(baseline["platform"], current)
    if diff and not force:
        raise BaselineError(
            f"{result_file} was measured on another platform than baseline {base_file} (differs in "
            f"{', '.join(diff)}: {platform_label(current)} vs {platform_label(baseline['platform'])}); "
            f"refusing to compare (--force compares anyway)")
    return [f"compared across platforms (forced): {k} {current.get(k)!r} vs baseline {baseline['platform'].get(k)!r}"
            for k in diff]


SPEED_ALPHA = 0.05  # a false alarm on an unchanged build, over the runs gated
SPEED_BETA = 0.10  # the miss rate at the smallest detectable slowdown the gate states


def speed_t_test(base: list[float], current: list[float], runs_gated: int) -> tuple[float, float, float, float]:
    """A one-sided two-sample Student t test of "not slower" on log speeds, the variance pooled from
    both (``scipy.stats``), at ``SPEED_ALPHA`` over the runs gated: the change, its p, the level,
    the smallest slowdown it could detect with ``1 - SPEED_BETA`` power."""
    import math

    from scipy.stats import t as student

    a, b = [math.log(v) for v in base], [math.log(v) for v in current]
    ss = sum((x - statistics.fmean(a)) ** 2 for x in a) + sum((x - statistics.fmean(b)) ** 2 for x in b)
    df = len(a) + len(b) - 2
    se = max(math.sqrt(ss / df * (1 / len(a) + 1 / len(b))), 1e-12)
    diff = statistics.fmean(b) - statistics.fmean(a)
    level = SPEED_ALPHA / max(1, runs_gated)
    p = float(student.cdf(diff / se, df))  # small: slower than the baseline's repeats allow
    detectable = 1 - math.exp(-(float(student.isf(level, df)) + float(student.isf(SPEED_BETA, df))) * se)
    return math.exp(diff) - 1, p, level, detectable


def speed_test_gate(name: tuple[str, str], base: dict[str, Any], reps: list[dict[str, Any]], runs_gated: int) -> Gate:
    """The current repeats' speeds (their fastest steps', ``baselines.fastest_tok_s``) against the
    baseline's repeats (``speed_t_test``): the band comes from the baseline's own repeats and
    their count, and the gate states the smallest slowdown it could have detected."""
    import math

    repeats = base["fastest_tok_s_repeats"]
    change, p, level, detectable = speed_t_test(repeats, [r["fastest_tok_s"] for r in reps], runs_gated)
    spread = statistics.stdev(math.log(v) for v in repeats)
    reps_word = f" (median of {len(reps)} repeats)" if len(reps) > 1 else ""
    return Gate(*name, "throughput", p >= level,
                f"{statistics.median(r['fastest_tok_s'] for r in reps):.1f} tok/s{reps_word}",
                f"{statistics.median(repeats):.1f} tok/s",
                f"p >= {level:.2g} that it is not slower (t test against {len(repeats)} baseline repeats of spread "
                f"{spread:.1%})", f"{change:+.1%}, p = {p:.2g}; could have detected a {detectable:.1%} "
                f"slowdown (fastest-steps speed)")


OLD_BASELINE = "the baseline"
OLD_RESULTS = "these results"


def throughput_gate(name: tuple[str, str], base: dict[str, Any], current: list[float], tol: Tolerances,
                    older: str = OLD_BASELINE) -> Gate:
    """Where ``older`` (``OLD_BASELINE`` or ``OLD_RESULTS``) lacks the repeats' fastest-steps speeds
    (made before they were kept, weighed as ``baselines.fastest_tok_s`` weighs them): fail only on a
    slowdown beyond max(configured %, spread multiple x measured repeat spread)."""
    now = statistics.median(current)
    allowed = tol.slowdown_allowed(base["tok_s_spread"])
    change = now / base["median_tok_s"] - 1
    threshold = (f"-{allowed:.1%} = max({tol.throughput_pct:g}% configured, {tol.spread_multiple:g} x "
                 f"{base['tok_s_spread']:.1%} repeat spread over {base['repeats']} repeats)")
    reps = f" (median of {len(current)} repeats)" if len(current) > 1 else ""
    remake = ("remake it (baseline update) for a band from its repeats" if older == OLD_BASELINE
              else "rerun them with this version for a test against the baseline's repeats")
    detail = (f"{change:+.1%}; {older} came from a version that did not keep each repeat's fastest-steps speed "
              f"as this one weighs it: {remake}")
    if allowed >= 0.5:
        detail += "; the baseline is too noisy to catch smaller slowdowns (more repeats or longer runs help)"
    return Gate(*name, "throughput", change >= -allowed, f"{now:.1f} tok/s{reps}", f"{base['median_tok_s']:.1f} tok/s",
                threshold, detail)


def loss_gate(name: tuple[str, str], base: dict[str, Any], repeats: list[list[float]], tol: Tolerances) -> Gate:
    """Every step's loss of every current repeat within the tolerance of the golden per-step loss."""
    golden = base["losses"]
    allowed = tol.loss_allowed(base["loss_spread"])
    threshold = (f"{allowed:.3g} = max({tol.loss_abs:g} configured, {tol.spread_multiple:g} x "
                 f"{base['loss_spread']:.3g} repeat spread)")
    for losses in repeats:
        if len(losses) != len(golden):
            return Gate(*name, "loss", False, f"{len(losses)} steps", f"{len(golden)} steps", threshold,
                        "the run trained a different number of steps")
    worst, step, now, then = max((abs(x - g), i + 1, x, g) for losses in repeats
                                 for i, (x, g) in enumerate(zip(losses, golden, strict=True)))
    return Gate(*name, "loss", worst <= allowed, f"{now:.6f} at step {step}", f"{then:.6f}", threshold,
                f"max |delta| {worst:.3g} over {len(golden)} steps")


def memory_gates(name: tuple[str, str], base: dict[str, Any], repeats: list[dict[str, Any]],
                 tol: Tolerances) -> list[Gate]:
    """Each rank's peak (MLX and process RSS) within ``memory_pct`` % of the baseline, either way."""
    gates = []
    for key, label in (("mlx_peak_bytes", "peak MLX memory"), ("rss_peak_bytes", "peak RSS")):
        now = median_per_rank([r[key] for r in repeats])
        then = base[key]
        if len(now) != len(then):
            gates.append(Gate(*name, label, False, f"{len(now)} ranks", f"{len(then)} ranks", "same world size"))
            continue
        changes = [n / t - 1 if t else 0.0 for n, t in zip(now, then, strict=True)]
        rank = max(range(len(now)), key=lambda i: abs(changes[i]))
        ok = all(abs(c) <= tol.memory_pct / 100 for c in changes)
        gates.append(Gate(*name, label, ok, f"{now[rank] / MB:.1f} MB on rank {rank}",
                          f"{then[rank] / MB:.1f} MB", f"±{tol.memory_pct:g}%",
                          f"{changes[rank]:+.1%}; per rank " + " / ".join(f"{n / MB:.1f}" for n in now)))
    return gates


def gate(baseline: dict[str, Any], docs: list[tuple[Path, dict[str, Any]]], tol: Tolerances, force: bool = False
         ) -> tuple[list[Gate], list[str], list[tuple[str, str, dict[str, Any], dict[str, Any]]]]:
    """Gate every run of ``docs`` the baseline holds. Returns the gates, notes on runs that were
    not compared, and (scenario, run, baseline entry, current figures) for each compared run. A
    run at another precision than its baseline's is refused (``BaselineError``) unless ``force``."""
    gates: list[Gate] = []
    notes: list[str] = []
    compared = []
    pooled = collect_repeats(docs)
    gated = sum(1 for scenario, run in pooled if run in baseline["scenarios"].get(scenario, {}))
    for (scenario, run), entry in pooled.items():
        base = baseline["scenarios"].get(scenario, {}).get(run)
        name = (scenario, run)
        if base is None:
            notes.append(f"{scenario}/{run}: not in the baseline, not gated")
            continue
        if entry["failed"]:
            gates.append(Gate(*name, "run", False, f"{entry['failed']} failed repeat(s)", "passed",
                              "every repeat passes"))
            continue
        reps = entry["repeats"]
        then, now = base.get("precision"), reps[0].get("precision")
        if then and now and then != now:
            if not force:
                raise BaselineError(f"{scenario}/{run} ran at precision {now}, its baseline at {then}: refusing to "
                                    f"compare (--force compares anyway)")
            notes.append(f"{scenario}/{run}: compared across precisions (forced): {now} vs baseline {then}")
        if base.get("fastest_tok_s_repeats") and all(r.get("fastest_tok_s") for r in reps):
            gates.append(speed_test_gate(name, base, reps, gated))
        else:
            older = OLD_BASELINE if not base.get("fastest_tok_s_repeats") else OLD_RESULTS
            gates.append(throughput_gate(name, base, [r["median_tok_s"] for r in reps], tol, older))
        gates.append(loss_gate(name, base, [r["losses"] for r in reps], tol))
        gates.extend(memory_gates(name, base, reps, tol))
        current = {"median_tok_s": statistics.median(r["median_tok_s"] for r in reps),
                   "runtime_s": statistics.median(r["runtime_s"] for r in reps),
                   "avg_loss": reps[0]["avg_loss"], "final_loss": reps[0]["final_loss"],
                   "world_size": entry["world_size"], "model": entry["model"]}
        compared.append((scenario, run, base, current))
    seen = {(g.scenario, g.run) for g in gates}
    absent = sorted(set(baseline["scenarios"]) - {s for s, _ in seen})
    if absent:
        notes.append(f"baseline scenarios not in the results (not gated): {', '.join(absent)}")
    for scenario in sorted({s for s, _ in seen}):
        missing = [r for r in baseline["scenarios"][scenario] if (scenario, r) not in seen]
        if missing:
            notes.append(f"{scenario}: baseline runs not in the results: {', '.join(missing)}")
    if not gates:
        raise BaselineError("no run of the results is in the baseline: nothing to gate")
    return gates, notes, compared
