"""Each side of an observer-effect repeat (``observer_effect.py``): run bare or under the harness,
one after the other or at once taking turns (``--turns``: ``taking_turns``), and its rate
over the timed window."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import timed_script
from bare_trainers import bare_env
from gpu_clocks import GpuClocks
from taking_turns import run_at_once

from harness import ablation
from harness.rank import turns

OBSERVER = Path(__file__).with_name("observer_effect.py")  # its ``--bare`` runs a bare side
# mlx-lm bare, reporting every optimizer step as its adapter has it report (its own default: every
# 10): what that reporting costs mlx-lm by itself, apart from what the harness does
EVERY_STEP = "bare_every_step"
BARE_SIDES = ("bare", EVERY_STEP)  # the sides that run a trainer bare: no figure of the harness's own


def window_rate(marks: list[dict[str, Any]], first: int) -> tuple[float, int, int]:
    """Global tokens per second from the mark at step ``first`` (or the first after it) to the last."""
    start = next(m for m in marks if m["step"] >= first)
    end = marks[-1]
    return window_tokens(marks, first) / (end["time"] - start["time"]), start["step"], end["step"]


def window_tokens(marks: list[dict[str, Any]], first: int) -> int:
    """Global tokens from the mark at step ``first`` (or the first after it) to the last."""
    return marks[-1]["tokens"] - next(m for m in marks if m["step"] >= first)["tokens"]


def reported_rate(marks: list[dict[str, Any]], first: int) -> float:
    """What the harness itself reports over the same window: tokens over its steps' ``step_time_s``
    (the time between steps, less what its step-local probes took and turns waited)."""
    later = [m for m in marks if m["step"] > first]
    return (later[-1]["tokens"] - marks[first - 1]["tokens"]) / sum(m["step_time_s"] for m in later)


def harnessed(path: Path, run: str) -> list[dict[str, Any]]:
    """The run under the harness: rank 0's step events as marks (cumulative global tokens)."""
    from harness.controller.run_job import execute
    from harness.scenario import load_scenario
    from harness.scenario.plan import job_for

    s = load_scenario(path)
    job = job_for(s, run)
    out = execute(f"observer_{run}", job, 1)
    if not out.ok:
        raise SystemExit(f"{run} under the harness: {out.failure}")
    marks, total = [], 0
    for e in out.ranks[0].events:
        if e.get("kind") == "step":
            total += int(e["tokens_global"])
            marks.append({"step": e["step"], "time": e["time"], "tokens": total, "step_time_s": e["step_time_s"]})
    return marks


def harness_side(path: Path, run: str, off: str) -> list[dict[str, Any]]:
    """The run under the harness, with the parts ``off`` names turned off (``harness.ablation``)."""
    if not off:
        return harnessed(path, run)
    os.environ[ablation.VAR] = off  # the ranks inherit it
    try:
        return harnessed(path, run)
    finally:
        del os.environ[ablation.VAR]


def run_side(side: str, t: str, path: Path, d: Path, a: argparse.Namespace) -> dict[str, float]:
    """One side's run of trainer ``t``: its tok/s over the window (and under the harness, its own figure)."""
    if side in BARE_SIDES:
        marks = d / f"{t}.marks.json"
        subprocess.run([sys.executable, str(OBSERVER), "--bare", str(path), t, str(marks), *bare_flags(side)],
                       check=True, env=bare_env(), stdout=subprocess.DEVNULL)
        return {side: window_rate(json.loads(marks.read_text()), a.first)[0]}
    marks_h = harness_side(path, t, a.ablate if side == "ablated" else "")
    return {side: window_rate(marks_h, a.first)[0], f"{side} reported": reported_rate(marks_h, a.first)}


def bare_flags(side: str) -> list[str]:
    """What a bare side's process is told beyond its scenario, run and marks file."""
    return ["--every-step"] if side == EVERY_STEP else []


def turn_rate(marks: list[dict[str, Any]], first: int, log: Path) -> tuple[float, float, float]:
    """Global tokens per second over the window (``window_rate``) less the seconds waited in it; the
    window's seconds and those waited."""
    return span_rate(next(m for m in marks if m["step"] >= first), marks[-1], log)


def span_rate(a: dict[str, Any], b: dict[str, Any], log: Path) -> tuple[float, float, float]:
    """Global tokens per second from mark ``a`` to mark ``b`` less the seconds waited between them
    (the turns' ``log``); those seconds, and the ones waited."""
    waited = turns.waited_within(log, a["time"], b["time"])
    return (b["tokens"] - a["tokens"]) / (b["time"] - a["time"] - waited), b["time"] - a["time"], waited


def half_rates(marks: list[dict[str, Any]], first: int, log: Path) -> list[float]:
    """``turn_rate``'s tok/s in each half of the window, split at the mark nearest its middle step
    (the halves of a repeat differ by the noise within one run; ``repeat_ratios.split_spread``); []
    where the window holds fewer than three marks."""
    window = [m for m in marks if m["step"] >= first]
    if len(window) < 3:
        return []
    middle = (window[0]["step"] + window[-1]["step"]) / 2
    mid = min(window[1:-1], key=lambda m: abs(m["step"] - middle))
    return [span_rate(a, b, log)[0] for a, b in ((window[0], mid), (mid, window[-1]))]


def side_command(side: str, t: str, path: Path, d: Path, a: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """One side of trainer ``t`` as a process of its own (its argv and environment): bare, or under
    the harness (with ``--ablate``'s parts off on the ablated side); its marks in
    ``d/{t}-{side}.marks.json``, the script's times in ``d/times-{side}``."""
    (times := d / f"times-{side}").mkdir(exist_ok=True)
    env = {**(bare_env() if side in BARE_SIDES else os.environ), timed_script.TIMES_VAR: str(times)}
    if side == "ablated":
        env[ablation.VAR] = a.ablate
    how = "--bare" if side in BARE_SIDES else "--harnessed"
    return [sys.executable, str(OBSERVER), how, str(path), t, str(d / f"{t}-{side}.marks.json"),
            *bare_flags(side)], env


def run_turns(order: list[str], t: str, path: Path, d: Path, a: argparse.Namespace, clocks: GpuClocks
              ) -> tuple[dict[str, float], dict[str, list[list[float]]], dict[str, list[float]],
                         dict[str, list[float]], dict[str, list[float]], dict[str, Any]]:
    """Both sides of trainer ``t`` at once, each in a process of its own, taking turns (``--turns``),
    ``order[0]`` first: each side's tok/s over its own turns (under the harness, its own figure
    too), for the script each side's split of the step and its own seconds a step, each side's
    window and the seconds it waited in it, its tok/s in each half of the window, and the
    repeat's timeline (``run_at_once``'s, with each side's first marked step and when it was done,
    s from launch)."""
    timeline = run_at_once({side: side_command(side, t, path, d, a) for side in order}, d, a.first, a.turns,
                           a.steps, t)
    marks = {side: json.loads((d / f"{t}-{side}.marks.json").read_text()) for side in order}
    timeline["first_mark"] = {side: [marks[side][0]["step"], round(marks[side][0]["time"] - timeline["launched"], 2)]
                              for side in order}  # step 1: every side that takes turns marks each step
    timeline["last_mark"] = {side: round(marks[side][-1]["time"] - timeline["launched"], 2) for side in order}
    timed = {side: turn_rate(marks[side], a.first, d / f"waits-{side}") for side in order}
    rep = {side: rate for side, (rate, _, _) in timed.items()}
    rep.update({f"{side} reported": reported_rate(marks[side], a.first) for side in order if side not in BARE_SIDES})
    split: dict[str, list[list[float]]] = {}
    own: dict[str, list[float]] = {}
    for side in order:
        split[side], own[side] = script_times(d / f"times-{side}", a.first, clocks)
    halves = {side: half_rates(marks[side], a.first, d / f"waits-{side}") for side in order}
    return (rep, split, own, {side: [window, waited] for side, (_, window, waited) in timed.items()}, halves,
            timeline)


def script_times(times: Path, first: int, clocks: GpuClocks) -> tuple[list[list[float]], list[float]]:
    """What the script's timing files in ``times`` hold (none where another trainer ran), each
    removed once read: its split of the step with the GPU's readings over the window after step
    ``first`` (``timed_script.split``, ``GpuClocks.over``), and its own seconds a step."""
    split: list[list[float]] = []
    own: list[float] = []
    for f in sorted(times.glob("*.json")):
        rows = (written := json.loads(f.read_text()))["rows"]
        split.append(timed_script.split(written, first) + clocks.over(rows[first - 1][0], rows[-1][0]))
        own += timed_script.own_steps(written, first)
        f.unlink()
    return split, own
