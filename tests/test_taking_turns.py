"""The observer-effect benchmark's sides taking turns (``observer_effect.py --turns``,
``timed_script.Baton``): the ring of turns, the waits left out of the step, and a run of it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("timed_script", REPO / "benchmarks" / "timed_script.py")
timed_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timed_script)


def test_two_sides_take_turns_k_steps_at_a_time_from_the_first_step_once_both_are_ready(tmp_path: Path) -> None:
    first, k, steps = 3, 2, 11
    env, fds = timed_script.turn_fifos(tmp_path, ["a", "b"], first, k)
    stepped: list[tuple[str, int]] = []
    lock = threading.Lock()

    def side(name: str, startup_s: float) -> None:
        baton = timed_script.Baton(env[name])
        time.sleep(startup_s)  # b starts late: a's window waits for it
        for step in range(1, steps + 1):
            with lock:
                stepped.append((name, step))
            time.sleep(0.002)
            baton.after(step)
        baton.hand_on()  # as the session's finish does

    starter = threading.Thread(target=timed_script.start_turns, args=(fds, 2))
    threads = [threading.Thread(target=side, args=("a", 0.0)), threading.Thread(target=side, args=("b", 0.3))]
    for th in [starter, *threads]:
        th.start()
    for th in [starter, *threads]:
        th.join(timeout=30)
        assert not th.is_alive()
    for fd in fds:
        os.close(fd)
    # every step up to the first of both comes before any step of the window
    warm = max(i for i, (_, s) in enumerate(stepped) if s <= first)
    window = stepped[warm + 1:]
    assert all(s > first for _, s in window) and len(window) == 2 * (steps - first)
    # the window: a (the first side) k steps, then b k steps, and so on, each side's steps in order
    assert [n for n, _ in window] == (["a"] * k + ["b"] * k) * ((steps - first) // k)
    assert [s for n, s in window if n == "a"] == list(range(first + 1, steps + 1))


def test_a_side_whose_turn_never_comes_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env, fds = timed_script.turn_fifos(tmp_path, ["a", "b"], 1, 1)
    monkeypatch.setattr(timed_script, "TURN_WAIT_S", 0.1)
    baton = timed_script.Baton(env["b"])
    with pytest.raises(SystemExit, match=r"^no turn came in 0 s: the other side stopped$"):
        baton.after(1)  # ready, and nobody starts the turns
    for fd in fds:
        os.close(fd)


def test_the_seconds_waiting_for_a_turn_are_left_out_of_the_step() -> None:
    # rows: time, s in probe, s in step, s in gc, full collections, CPU, s waiting for a turn
    rows = [[0.0, 0, 0, 0, 0, 1, 0.0], [1.0, 0, 0.1, 0, 0, 1, 0.0], [2.5, 0, 0.2, 0, 0, 1, 0.5],
            [3.5, 0, 0.3, 0, 0, 1, 0.5], [5.0, 0, 0.4, 0, 0, 1, 1.0]]
    written = {"rows": rows, "objects": 10}
    assert timed_script.window_seconds(written, 2) == pytest.approx(3.0)  # 4 s from step 2 to 5, 1 s of it waiting
    split = timed_script.split(written, 2)
    assert split[:2] == pytest.approx([0.9, 0.1]) and split[5] == pytest.approx(0.9)  # own: mean and median
    old = {"rows": [r[:6] for r in rows], "objects": 10}  # rows recorded before turns: nothing waited
    assert timed_script.window_seconds(old, 2) == pytest.approx(4.0)


@pytest.mark.parametrize("args", [["--trainers", "mlx_lm"], ["--turns", "0"],
                                  ["--ablate", "sampler", "--sides", "harness,ablated"]])
def test_turns_for_anything_but_the_scripts_two_sides_are_refused_in_one_line(args: list[str]) -> None:
    cmd = [sys.executable, str(REPO / "benchmarks" / "observer_effect.py"), "--trainers", "script", "--turns", "5"]
    p = subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("--turns ") and "for --trainers script alone and two sides, one of them bare" in p.stderr


@pytest.mark.full  # a benchmark, run small: both sides at once, taking turns
@pytest.mark.ranks
def test_the_observer_benchmark_runs_the_scripts_sides_taking_turns(tmp_path: Path) -> None:
    record = tmp_path / "turns.jsonl"
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "observer_effect.py"), "--model", "cpu3m",
                        "--trainers", "script", "--steps", "8", "--from", "2", "--turns", "2", "--repeats", "2",
                        "--record", str(record)], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    head, *repeats = (json.loads(line) for line in record.read_text().splitlines())
    assert head["plan"]["--turns"] == 2 and len(repeats) == 2
    for r in repeats:
        rates = r["data"]["rates"]["script"]
        assert set(rates) == {"bare", "harness", "harness reported"} and all(v > 0 for v in rates.values())
        # the harness's own figure is its step events' time less its waits: near the rate timed outside
        assert rates["harness reported"] == pytest.approx(rates["harness"], rel=0.1)
        assert {side: len(rows) for side, rows in r["data"]["split"].items()} == {"bare": 1, "harness": 1}
    assert "taking turns 2 steps at a time" in p.stdout
