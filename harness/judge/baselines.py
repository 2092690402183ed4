"""Baselines: per-platform reference figures built from repeated results, with their tolerances.

A baseline holds, for each scenario run, the median post-step-1 tok/s over the repeats and its
repeat-to-repeat spread, the mean per-step losses and how far repeats strayed from them, and the
per-rank memory peaks. It is keyed by platform (OS, chip/CPU, device, mlx version): figures from
another platform say nothing about a regression on this one.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import schema

PLATFORM_KEYS = ("os_name", "cpu", "device", "mlx_version")


class BaselineError(ValueError):
    """A baseline cannot be built or used; the message names the file or run and why."""


@dataclass
class Tolerances:
    """How far a result may stray from a baseline before the gate fails.

    Throughput fails only on a slowdown larger than ``max(throughput_pct %, spread_multiple x
    the baseline's measured repeat spread)``. Losses fail when a step's loss differs by more than
    ``max(loss_abs, spread_multiple x the largest repeat-to-repeat loss difference)``. Per-rank
    memory peaks fail when more than ``memory_pct`` % above or below the baseline.
    """

    throughput_pct: float = 10.0
    spread_multiple: float = 3.0
    loss_abs: float = 1e-5
    memory_pct: float = 10.0

    def slowdown_allowed(self, spread: float) -> float:
        """The fraction of baseline tok/s a run may lose, given the baseline's repeat spread."""
        return max(self.throughput_pct / 100, self.spread_multiple * spread)

    def loss_allowed(self, spread: float) -> float:
        """The per-step loss difference allowed, given the baseline's repeat-to-repeat loss spread."""
        return max(self.loss_abs, self.spread_multiple * spread)

    def updated(self, **overrides: float | None) -> Tolerances:
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})


def platform_key(env: dict[str, Any]) -> dict[str, Any]:
    """The platform a result was measured on, as baselines are keyed."""
    return {k: env.get(k) for k in PLATFORM_KEYS}


def platform_label(key: dict[str, Any]) -> str:
    return ", ".join(f"{k}={key.get(k)!r}" for k in PLATFORM_KEYS)


def platform_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k in PLATFORM_KEYS if a.get(k) != b.get(k)]


def relative_spread(values: list[float]) -> float:
    """Repeat-to-repeat spread: the sample standard deviation over the median (0 for one value)."""
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    return statistics.stdev(values) / mid if mid else 0.0


FAST_SHARE = 0.1  # the fastest tenth of a run's steps
FAST_TOK_S = "fastest-tenth tok/s"  # what the gates call that speed


def fastest_tok_s(run: dict[str, Any]) -> float | None:
    """The speed of a run's fastest steps after the first: its tokens per step over the time of
    its fastest tenth of steps (at least one), each step's time weighed by the work it does, its
    padded input width where the run reports one per step, else its tokens. Another process only
    slows steps down, so this moves less between runs on a shared machine than the median, while
    a trainer that is slower in every step is slower in it too. Ranking steps by their tok/s
    instead (before 2026-12) picked the steps with the most unpadded tokens as much as the
    quickest ones, though a padded step costs the same whatever its tokens: between two runs of
    ``speed_gate`` on 2 cores that spread 4.1 % (1 rank) and 3.8 % (2 ranks) against 2.2 % and
    3.0 % for this (docs/benchmarks.md). Without per-step tokens: the mean tok/s of the fastest
    tenth."""
    speeds = run.get("tok_s_global") or []
    tokens = run.get("tokens_global_per_step") or []
    widths = run.get("input_widths") or []
    steps = range(1, len(speeds))
    if len(tokens) != len(speeds) or any(not speeds[k] or not tokens[k] for k in steps):
        fast = sorted(v for v in speeds[1:] if v)
        return statistics.fmean(fast[-max(1, round(FAST_SHARE * len(fast))):]) if fast else run.get("median_tok_s")
    if not steps:
        return run.get("median_tok_s")
    padded = len(widths) == len(speeds) and all(isinstance(widths[k], int) and widths[k] > 0 for k in steps)
    work = {k: float(widths[k] if padded else tokens[k]) for k in steps}
    time = {k: tokens[k] / speeds[k] for k in steps}
    fastest = sorted(steps, key=lambda k: time[k] / work[k])[:max(1, round(FAST_SHARE * len(steps)))]
    per_work = sum(tokens[k] for k in steps) / sum(work.values())
    return per_work * sum(work[k] for k in fastest) / sum(time[k] for k in fastest)


def repeat_figures(run: dict[str, Any]) -> dict[str, Any]:
    """What one repeat of a run contributes to a baseline (kept in ``result.json`` per repeat)."""
    keys = ("ok", "median_tok_s", "runtime_s", "losses", "mlx_peak_bytes", "rss_peak_bytes", "avg_loss",
            "final_loss")
    return {**{k: run.get(k) for k in keys}, "fastest_tok_s": fastest_tok_s(run),
            "precision": (run.get("precision") or {}).get("label")}


def run_repeats(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Every repeat of a run summary: the ``repeats`` it carries, or the run itself."""
    return run.get("repeats") or [repeat_figures(run)]


def median_per_rank(samples: list[list[int]]) -> list[int]:
    """Each rank's median over repeats of per-rank figures (memory peaks)."""
    return [int(statistics.median(vals)) for vals in zip(*samples, strict=True)]


def summarize_run(where: str, repeats: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """A baseline entry from a run's repeats (all of them passed)."""
    steps = {len(r["losses"]) for r in repeats}
    if len(steps) != 1:
        counts = ", ".join(map(str, sorted(steps)))
        raise BaselineError(f"{where}: repeats ran different step counts {counts}")
    ranks = {len(r["rss_peak_bytes"]) for r in repeats}
    if ranks != {world_size}:
        counts = " and ".join(map(str, sorted(ranks)))
        raise BaselineError(f"{where}: repeats report {counts} ranks, expected {world_size}")
    tok_s = [r["median_tok_s"] for r in repeats]
    fast = [r.get("fastest_tok_s") for r in repeats]
    losses = [statistics.fmean(step) for step in zip(*(r["losses"] for r in repeats), strict=True)]
    loss_spread = max(abs(x - m) for r in repeats for x, m in zip(r["losses"], losses, strict=True))
    return {
        "world_size": world_size,
        "repeats": len(repeats),
        "median_tok_s": statistics.median(tok_s),
        "tok_s_repeats": tok_s,
        "tok_s_spread": relative_spread(tok_s),
        "fastest_tok_s_repeats": fast if None not in fast else None,  # what the speed gate tests against
        "precision": repeats[0].get("precision"),
        "runtime_s": statistics.median(r["runtime_s"] for r in repeats),
        "losses": losses,
        "loss_spread": loss_spread,
        "avg_loss": statistics.fmean(losses),
        "final_loss": losses[-1],
        "mlx_peak_bytes": median_per_rank([r["mlx_peak_bytes"] for r in repeats]),
        "rss_peak_bytes": median_per_rank([r["rss_peak_bytes"] for r in repeats]),
    }


def collect_repeats(docs: list[tuple[Path, dict[str, Any]]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Runs of the given results by (scenario, run), with all their passing repeats pooled
    (a result's own ``--repeat`` repeats and the same run in other results alike), and the
    harness revisions those results ran (``revisions``). Runs expected to fail and noise-floor
    runs (measurements for the parity checks) are not gated."""
    pooled: dict[tuple[str, str], dict[str, Any]] = {}
    for _, doc in docs:
        for s in doc["scenarios"]:
            for run in s["runs"]:
                if run.get("expect_error") or run.get("floor"):
                    continue
                entry = pooled.setdefault((s["name"], run["name"]), {
                    "world_size": run["world_size"], "model": s.get("model"), "kind": s.get("kind", "parity"),
                    "repeats": [], "failed": 0, "revisions": []})
                revision = doc["environment"].get("git_revision")
                if revision not in entry["revisions"]:
                    entry["revisions"].append(revision)
                for rep in run_repeats(run):
                    if rep.get("ok"):
                        entry["repeats"].append(rep)
                    else:
                        entry["failed"] += 1
    return pooled


def build_baseline(docs: list[tuple[Path, dict[str, Any]]], tolerances: Tolerances,
                   min_repeats: int = 2) -> dict[str, Any]:
    """A baseline from results of one platform; every run needs ``min_repeats`` passing repeats."""
    if not docs:
        raise BaselineError("no results given")
    first_file, first = docs[0]
    key = platform_key(first["environment"])
    for f, doc in docs[1:]:
        diff = platform_differences(key, platform_key(doc["environment"]))
        if diff:
            raise BaselineError(f"{f}: measured on another platform than {first_file} "
                                f"(differs in {', '.join(diff)}); a baseline holds one platform")
    scenarios: dict[str, dict[str, Any]] = {}
    for (scenario, run), entry in collect_repeats(docs).items():
        where = f"{scenario}/{run}"
        if entry["failed"]:
            raise BaselineError(f"{where}: {entry['failed']} repeat(s) failed; a baseline needs passing runs")
        if len(entry["repeats"]) < min_repeats:
            raise BaselineError(f"{where}: {len(entry['repeats'])} repeat(s); measuring the repeat spread needs "
                                f"at least {min_repeats} (run with --repeat 3, or give several results)")
        figures = summarize_run(where, entry["repeats"], entry["world_size"])
        scenarios.setdefault(scenario, {})[run] = {"model": entry["model"], "kind": entry["kind"], **figures,
                                                   "git_revision": revisions_label(entry["revisions"])}
    return schema.stamp({
        "kind": "baseline",
        "platform": key,
        "environment": first["environment"],
        "git_revision": first["environment"].get("git_revision"),  # the latest results'; each run keeps its own
        "results": len(docs),
        "tolerances": dataclasses.asdict(tolerances),
        "scenarios": scenarios,
    })


def revisions_label(revisions: list[str | None]) -> str | None:
    """The harness revisions a baseline entry's repeats ran, as one label (None: not known)."""
    known = [r for r in revisions if r]
    return ", ".join(known) if known else None


def merged_baseline(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` with the scenarios of ``old`` (a baseline of the same platform) it does not cover,
    each run keeping the revision it was measured at (an entry from before runs kept their own:
    ``old``'s)."""
    kept = {name: {run: {"git_revision": old.get("git_revision"), **entry} for run, entry in runs.items()}
            for name, runs in old["scenarios"].items() if name not in new["scenarios"]}
    return {**new, "scenarios": {**kept, **new["scenarios"]}}


def entry_environment(baseline: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """The environment one run of ``baseline`` was measured in: the file's, at the entry's own
    revision where it keeps one (a merged baseline's runs come from several)."""
    env = baseline["environment"]
    return {**env, "git_revision": entry["git_revision"]} if entry.get("git_revision") else env


def read_baseline(path: Path) -> dict[str, Any]:
    """A baseline file, checked for its schema version and shape (``BaselineError`` names it)."""
    if not path.is_file():
        raise BaselineError(f"{path}: baseline not found")
    try:
        doc = schema.read_json(path)
    except schema.SchemaError as e:
        raise BaselineError(str(e).splitlines()[0]) from e
    if doc.get("kind") != "baseline" or not isinstance(doc.get("scenarios"), dict):
        raise BaselineError(f"{path}: not a baseline (write one with `mlx-ddp-harness baseline update`)")
    try:
        Tolerances(**doc.get("tolerances", {}))
    except TypeError as e:
        raise BaselineError(f"{path}: bad tolerances ({e})") from e
    return doc


def baseline_target(given: str) -> tuple[Path, bool]:
    """Where ``baseline update --baseline GIVEN`` writes: the path, and whether it is a directory
    (the platform's file goes into it). A path that exists is taken as it is, a directory or a
    file; a new path ending in ``/`` is a directory, one ending in ``.json`` a file, both in a
    directory that exists. Any other new path is ambiguous and refused (``BaselineError``)."""
    path = Path(given)
    if path.is_dir():
        return path, True
    is_dir = given.endswith(("/", os.sep))
    if path.exists():
        if is_dir:
            raise BaselineError(f"--baseline {given}: {path} is a file, not a directory")
        return path, False
    if not is_dir and path.suffix != ".json":
        raise BaselineError(f"--baseline {given}: no such file or directory; say which to write: {given}.json for "
                            f"a file, {given}/ for a directory (its file named after the platform)")
    if not path.parent.is_dir():
        raise BaselineError(f"--baseline {given}: {path.parent}: no such directory")
    return path, is_dir


def pick_baseline(path: Path, env: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """``path`` itself, or from a directory of baselines the one for ``env``'s platform."""
    if not path.is_dir():
        return path, read_baseline(path)
    files = sorted(path.glob("*.json"))
    docs = [(f, read_baseline(f)) for f in files]
    key = platform_key(env)
    for f, doc in docs:
        if not platform_differences(doc["platform"], key):
            return f, doc
    known = "; ".join(f"{f.name}: {platform_label(d['platform'])}" for f, d in docs) or "none"
    raise BaselineError(f"{path}: no baseline for this platform ({platform_label(key)}); baselines there: {known}")
