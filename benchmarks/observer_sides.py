"""Each side of an observer-effect repeat (``observer_effect.py``): run bare or under the harness,
one after the other or taking turns (``--turns``), and its rate over the timed window."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import timed_script
from bare_trainers import bare_env
from gpu_clocks import GpuClocks

from harness import ablation

OBSERVER = Path(__file__).with_name("observer_effect.py")  # its ``--bare`` runs a bare side


def window_rate(marks: list[dict[str, Any]], first: int) -> tuple[float, int, int]:
    """Global tokens per second from the mark at step ``first`` (or the first after it) to the last."""
    start = next(m for m in marks if m["step"] >= first)
    end = marks[-1]
    return window_tokens(marks, first) / (end["time"] - start["time"]), start["step"], end["step"]


def window_tokens(marks: list[dict[str, Any]], first: int) -> int:
    """Global tokens from the mark at step ``first`` (or the first after it) to the last."""
    return marks[-1]["tokens"] - next(m for m in marks if m["step"] >= first)["tokens"]


def reported_rate(marks: list[dict[str, Any]], first: int, waited: float = 0.0) -> float:
    """What the harness itself reports over the same window: tokens over its steps' ``step_time_s``
    (the time between steps, less what its step-local probes took), less ``waited`` (turns)."""
    later = [m for m in marks if m["step"] > first]
    return (later[-1]["tokens"] - marks[first - 1]["tokens"]) / (sum(m["step_time_s"] for m in later) - waited)


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
    if side == "bare":
        marks = d / f"{t}.marks.json"
        subprocess.run([sys.executable, str(OBSERVER), "--bare", str(path), t, str(marks)], check=True, env=bare_env(),
                       stdout=subprocess.DEVNULL)
        return {"bare": window_rate(json.loads(marks.read_text()), a.first)[0]}
    marks_h = harness_side(path, t, a.ablate if side == "ablated" else "")
    return {side: window_rate(marks_h, a.first)[0], f"{side} reported": reported_rate(marks_h, a.first)}


def run_turns(order: list[str], t: str, path: Path, d: Path, a: argparse.Namespace,
              clocks: GpuClocks) -> tuple[dict[str, float], dict[str, list[list[float]]]]:
    """Both sides of the script at once, taking turns (``--turns``), ``order[0]`` first: each side's tok/s
    over its own turns (under the harness, its own figure too) and its split of the step."""
    env, fds = timed_script.turn_fifos(d, order, a.first, a.turns)
    other = next(side for side in order if side != "bare")
    marks_b, times = d / f"{t}.marks.json", d / "times"
    bare = subprocess.Popen([sys.executable, str(OBSERVER), "--bare", str(path), t, str(marks_b)],
                            env={**bare_env(), timed_script.TURNS_VAR: env["bare"]}, stdout=subprocess.DEVNULL)

    def unblock() -> None:  # a bare side that failed hands the harness's side every turn it would wait for
        if bare.wait() != 0:
            os.write(fds[1 + order.index(other)], b"t" * a.steps)

    for job in (lambda: timed_script.start_turns(fds, len(order)), unblock):
        threading.Thread(target=job, daemon=True).start()
    os.environ[timed_script.TURNS_VAR] = env[other]  # the harness's rank inherits it
    try:
        marks = {other: harness_side(path, t, a.ablate if other == "ablated" else "")}
    except BaseException:
        bare.kill()
        raise
    finally:
        del os.environ[timed_script.TURNS_VAR]
    if bare.wait() != 0:
        raise SystemExit(f"{t} bare, taking turns: exit {bare.returncode}")
    for fd in fds:
        os.close(fd)
    marks["bare"] = json.loads(marks_b.read_text())
    rep: dict[str, float] = {}
    split: dict[str, list[list[float]]] = {}
    for f in sorted(times.glob("*.json")):
        side, written = "bare" if f.name.startswith("bare-") else other, json.loads(f.read_text())
        rows = written["rows"]
        rep[side] = window_tokens(marks[side], a.first) / timed_script.window_seconds(written, a.first)
        if side != "bare":
            rep[f"{side} reported"] = reported_rate(marks[side], a.first, rows[-1][6] - rows[a.first - 1][6])
        split[side] = [timed_script.split(written, a.first) + clocks.over(rows[a.first - 1][0], rows[-1][0])]
        f.unlink()
    return rep, split
