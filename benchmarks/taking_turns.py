"""Two processes of a benchmark at once, taking turns (``harness.rank.turns``): the ring of FIFOs
that passes the turn, its start once both are ready, and the two processes run to their end
(``observer_sides.py``'s sides, ``step_vs_mlx_lm.py``'s reference and bare step)."""

from __future__ import annotations

import json
import os
import select
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path

from harness.rank import turns


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def unwind_on_sigterm() -> None:
    """In a side's process: SIGTERM (``run_at_once`` interrupted) unwinds it, so that the harness's
    controller there stops its ranks, instead of ending it at once and leaving them."""
    signal.signal(signal.SIGTERM, _terminated)


def turn_fifos(d: Path, sides: list[str], first: int, k: int) -> tuple[dict[str, str], list[int]]:
    """Each side's ``harness.rank.turns`` setting for a ring of ``sides`` (the first hands on to the
    second, the last to the first) in directory ``d``, and the FIFOs opened here read-write: the
    ready one to read, then every side's, kept open so that no turn written is lost before its
    reader opens it. Each side's waits are logged to ``d/waits-{side}``; this process owns the turns
    (a side stops waiting once it is gone)."""
    paths = {side: d / f"turn-{side}" for side in [*sides, "ready"]}
    for path in paths.values():
        path.unlink(missing_ok=True)
        os.mkfifo(path)
    for side in sides:
        (d / f"waits-{side}").unlink(missing_ok=True)
    env = {side: json.dumps({"first": first, "k": k, "mine": str(paths[side]), "ready": str(paths["ready"]),
                             "next": str(paths[sides[(i + 1) % len(sides)]]), "log": str(d / f"waits-{side}"),
                             "owner": os.getpid()})
           for i, side in enumerate(sides)}
    return env, [os.open(paths[side], os.O_RDWR) for side in ["ready", *sides]]


def start_turns(fds: list[int], sides: int, began: dict[str, float] | None = None) -> None:
    """Once every side has said it is ready (``fds[0]``), the first turn to the first side
    (``fds[1]``), its time kept in ``began["turns"]`` (``time.monotonic``)."""
    got = 0
    while got < sides:
        if not select.select([fds[0]], [], [], turns.WAIT_S)[0]:
            return  # a side stopped before its window: its run reports why
        got += len(os.read(fds[0], sides - got))
    if began is not None:
        began["turns"] = time.monotonic()
    os.write(fds[1], b"t")


def run_at_once(sides: dict[str, tuple[list[str], dict[str, str]]], d: Path, first: int, k: int, steps: int,
                what: str) -> dict[str, object]:
    """Run each side's command (argv, environment) at once, the first side first, taking turns K
    steps at a time from step ``first`` of ``steps``, until both have ended. A side that fails
    hands the other every turn it would wait for; then ``SystemExit`` names ``what`` and each
    side that failed. Returns the repeat's timeline: when the sides were launched (``launched``,
    wall-clock seconds), and the seconds from then until the first turn (``turns_s``: every side
    started and ran its steps before ``first``; None where none began) and until each side ended
    (``ended_s``)."""
    order = list(sides)
    env, fds = turn_fifos(d, order, first, k)
    launched, t0, began, ended = time.time(), time.monotonic(), {}, {}
    procs = {side: subprocess.Popen(argv, env={**e, turns.VAR: env[side]}, stdout=subprocess.DEVNULL)
             for side, (argv, e) in sides.items()}

    def unblock(side: str) -> None:
        code = procs[side].wait()
        ended[side] = round(time.monotonic() - t0, 2)
        if code != 0:
            os.write(fds[1 + (1 - order.index(side))], b"t" * steps)

    threading.Thread(target=start_turns, args=(fds, len(order), began), daemon=True).start()
    watchers = [threading.Thread(target=unblock, args=(side,), daemon=True) for side in order]
    for w in watchers:
        w.start()
    try:
        for w in watchers:
            w.join()
    except BaseException:  # interrupted: each side's controller stops its ranks as it ends
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise
    failed = [f"{side} exited {procs[side].returncode}" for side in order if procs[side].returncode]
    if failed:  # the FIFOs stay open: the first turn may still be awaited
        raise SystemExit(f"{what} taking turns: {', '.join(failed)}")
    for fd in fds:
        os.close(fd)
    return {"launched": launched, "turns_s": round(began["turns"] - t0, 2) if "turns" in began else None,
            "ended_s": {side: ended[side] for side in order}}


def timeline_line(timelines: list[dict[str, object]], marked: dict[str, tuple[int, list[float]]] | None = None,
                  last: dict[str, list[float]] | None = None) -> str:
    """The repeats' timelines (``run_at_once``'s) as a report's line, medians over them: a
    repeat's seconds, the first turn's, each side's end and (where ``marked`` has them: per side
    its first marked step and when it was done, one a repeat) its first step's, and (where
    ``last`` has them) when its last step was done. What sets a repeat's length: the start-ups,
    or what a side does after its last step."""
    def med(values: list[float]) -> str:
        return f"{statistics.median(values):.1f}"

    sides = list(timelines[0]["ended_s"])
    ends = {side: [t["ended_s"][side] for t in timelines] for side in sides}
    first = [t["turns_s"] for t in timelines if t["turns_s"] is not None]
    text = f"a repeat's timeline (medians of {len(timelines)}, s from launch): the last side ended at " \
           f"{med([max(t['ended_s'].values()) for t in timelines])}"
    if first:
        some = f" in {len(first)} of them" if len(first) < len(timelines) else ""
        text += f", the turns began at {med(first)}{some} (every side started and ran its steps before them)"
    for side in sides:
        step, at = marked[side] if marked and marked.get(side) else (None, [])
        done = f"its last at {med(last[side])}, " if last and last.get(side) else ""
        text += f"; {side}: " + (f"its step {step} done at {med(at)}, " if at else "") + done + \
            f"ended at {med(ends[side])}"
    return text
