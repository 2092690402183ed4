"""The observer-effect benchmark's sides taking turns (``observer_effect.py --turns``,
``harness.rank.turns``): the ring of turns, the waits left out of the window and the step, and
runs of it with real ranks."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness.rank import turns
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))  # observer_sides imports its neighbours by name
_spec = importlib.util.spec_from_file_location("observer_sides", REPO / "benchmarks" / "observer_sides.py")
observer_sides = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(observer_sides)
timed_script = sys.modules["timed_script"]
taking_turns = sys.modules["taking_turns"]
_spec = importlib.util.spec_from_file_location("observer_effect", REPO / "benchmarks" / "observer_effect.py")
observer_effect = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(observer_effect)


def test_two_sides_take_turns_k_steps_at_a_time_from_the_first_step_once_both_are_ready(tmp_path: Path) -> None:
    first, k, steps = 3, 2, 11
    env, fds = taking_turns.turn_fifos(tmp_path, ["a", "b"], first, k)
    stepped: list[tuple[str, int]] = []
    lock = threading.Lock()

    def side(name: str, startup_s: float) -> None:
        baton = turns.Baton(json.loads(env[name]))
        time.sleep(startup_s)  # b starts late: a's window waits for it
        for step in range(1, steps + 1):
            with lock:
                stepped.append((name, step))
            time.sleep(0.002)
            baton.after(step)
        baton.hand_on()  # as the session's finish does

    starter = threading.Thread(target=taking_turns.start_turns, args=(fds, 2))
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
    # each side logged a wait at every turn it waited for: its first, then one every k steps but its last
    for name in ("a", "b"):
        waits = turns.waits(tmp_path / f"waits-{name}")
        assert len(waits) == (steps - first) // k + 1 and all(a <= b for a, b in waits)
    assert turns.waits(tmp_path / "waits-b")[0][1] - turns.waits(tmp_path / "waits-b")[0][0] < 0.3  # a's first turn
    assert turns.waits(tmp_path / "waits-a")[0][1] - turns.waits(tmp_path / "waits-a")[0][0] > 0.2  # waited for b


def test_a_repeats_timeline_says_when_the_turns_began_and_each_side_ended(tmp_path: Path) -> None:
    import taking_turns

    def side(startup_s: float) -> tuple[list[str], dict[str, str]]:  # 6 steps, taking turns after step 2
        code = ("import time\nfrom harness.rank import turns\n"
                f"time.sleep({startup_s})\n"
                "for step in range(1, 7):\n    time.sleep(0.01)\n    turns.after(step)\n"
                "turns.hand_on()\n")
        return [sys.executable, "-c", code], {**os.environ, "PYTHONPATH": str(REPO)}

    timeline = taking_turns.run_at_once({"a": side(0.0), "b": side(1.0)}, tmp_path, 2, 2, 6, "two sides")
    assert 1.0 < timeline["turns_s"] < 20  # b's start-up and its first two steps came first
    assert set(timeline["ended_s"]) == {"a", "b"} and min(timeline["ended_s"].values()) > timeline["turns_s"]
    assert abs(timeline["launched"] - time.time()) < 60
    line = taking_turns.timeline_line([timeline, {**timeline, "turns_s": None}], {"a": (1, [0.5, 0.7]),
                                                                                   "b": (10, [1.5, 1.7])})
    assert line.startswith(f"a repeat's timeline (medians of 2, s from launch): the last side ended at "
                           f"{max(timeline['ended_s'].values()):.1f}, the turns began at {timeline['turns_s']:.1f} "
                           "in 1 of them ")
    assert line.endswith(f"; a: its step 1 done at 0.6, ended at {timeline['ended_s']['a']:.1f}; b: its step 10 "
                         f"done at 1.6, ended at {timeline['ended_s']['b']:.1f}")
    line = taking_turns.timeline_line([timeline], {"a": (1, [0.5])}, {"a": [3.25], "b": []})
    assert line.endswith(f"; a: its step 1 done at 0.5, its last at 3.2, ended at {timeline['ended_s']['a']:.1f}; b: "
                         f"ended at {timeline['ended_s']['b']:.1f}")


def test_only_the_waits_within_a_window_are_left_out_of_it(tmp_path: Path) -> None:
    log = tmp_path / "waits"
    log.write_text("10.0 11.0\n12.5 13.0\n20.0 21.0\n")
    assert turns.waited_within(log, 10.5, 20.5) == pytest.approx(0.5 + 0.5 + 0.5)  # two partly, one whole
    assert turns.waited_within(tmp_path / "none", 0.0, 100.0) == 0.0  # a side that never waited


def test_a_side_whose_turn_never_comes_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env, fds = taking_turns.turn_fifos(tmp_path, ["a", "b"], 1, 1)
    monkeypatch.setattr(turns, "WAIT_S", 0.1)
    baton = turns.Baton(json.loads(env["b"]))
    with pytest.raises(SystemExit, match=r"^no turn came in 0 s: the other side stopped$"):
        baton.after(1)  # ready, and nobody starts the turns
    for fd in fds:
        os.close(fd)


def test_a_side_stops_waiting_once_the_benchmark_that_set_the_turns_is_gone(tmp_path: Path) -> None:
    env, fds = taking_turns.turn_fifos(tmp_path, ["a", "b"], 1, 1)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    spec = json.loads(env["b"])
    assert spec["owner"] == os.getpid()  # the benchmark's own pid
    baton = turns.Baton({**spec, "owner": gone.pid})
    began = time.monotonic()
    with pytest.raises(SystemExit, match=rf"^the benchmark that set the turns \(pid {gone.pid}\) is gone: no turn "
                                         r"will come$"):
        baton.after(1)  # ready, and nobody will start the turns
    assert time.monotonic() - began < 3 * turns.OWNER_POLL_S  # not the 900 s a turn is waited for
    for fd in fds:
        os.close(fd)


def test_the_seconds_waiting_for_a_turn_are_left_out_of_the_step() -> None:
    # rows: time, s in probe, s in step, s in gc, full collections, CPU, s waiting for a turn
    rows = [[0.0, 0, 0, 0, 0, 1, 0.0], [1.0, 0, 0.1, 0, 0, 1, 0.0], [2.5, 0, 0.2, 0, 0, 1, 0.5],
            [3.5, 0, 0.3, 0, 0, 1, 0.5], [5.0, 0, 0.4, 0, 0, 1, 1.0]]
    split = timed_script.split({"rows": rows, "objects": 10}, 2)  # 4 s from step 2 to 5, 1 s of it waiting
    assert split[:2] == pytest.approx([0.9, 0.1]) and split[5] == pytest.approx(0.9)  # own: mean and median
    old = timed_script.split({"rows": [r[:6] for r in rows], "objects": 10}, 2)  # rows before turns: no waits
    assert old[0] == pytest.approx(4.0 / 3 - 0.1)
    marks = [{"step": s, "time": 100.0 + s, "tokens": 10 * s} for s in range(1, 6)]
    log = Path(os.devnull)
    assert observer_sides.turn_rate(marks, 2, log) == pytest.approx((10.0, 3.0, 0.0))  # 30 tokens in 3 s


def test_each_half_of_the_window_has_its_rate_with_the_turns_waited_in_it_left_out(tmp_path: Path) -> None:
    marks = [{"step": s, "time": 100.0 + s + (0.5 if s > 5 else 0.0), "tokens": 10 * s} for s in range(1, 8)]
    (log := tmp_path / "waits").write_text("105.0 105.5\n")  # the second half waited half a second
    # the window runs from step 2 to 7, split at step 4 (the mark nearest its middle, 4.5)
    assert observer_sides.half_rates(marks, 2, log) == pytest.approx([10.0, 10.0])  # 20 in 2 s, 30 in 3.5 - 0.5
    assert observer_sides.half_rates(marks, 2, Path(os.devnull)) == pytest.approx([10.0, 30 / 3.5])
    assert observer_sides.half_rates(marks[:3], 1, log) == pytest.approx([10.0, 10.0])
    assert observer_sides.half_rates(marks, 6, log) == []  # two marks: no halves


@pytest.mark.parametrize(("args", "needle"), [
    (["--trainers", "mlx_vlm"], "for trainers of mlx_lm, script, unsloth_zoo and two sides"),
    (["--turns", "0"], "K of at least 1"),
    (["--ablate", "sampler"], "two sides (got --trainers script, sides bare,harness,ablated)"),
])
def test_turns_the_sides_cannot_take_are_refused_in_one_line(args: list[str], needle: str) -> None:
    cmd = [sys.executable, str(REPO / "benchmarks" / "observer_effect.py"), "--trainers", "script", "--turns", "5"]
    p = subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("--turns ") and needle in p.stderr, p.stderr


@pytest.mark.full  # a benchmark, run small: both sides at once, taking turns
@pytest.mark.ranks
@pytest.mark.parametrize(("trainer", "steps", "first", "k", "sides"), [
    ("script", 8, 2, 2, ("bare", "harness")), ("unsloth_zoo", 8, 2, 2, ("bare", "harness")),
    ("mlx_lm", 8, 2, 2, ("bare", "harness")), ("script", 8, 2, 3, ("harness", "ablated")),
    ("mlx_lm", 8, 2, 2, ("bare_every_step", "harness"))])  # bare mlx-lm marks every step: turns of any K
def test_the_observer_benchmark_runs_both_sides_taking_turns(tmp_path: Path, trainer: str, steps: int, first: int,
                                                             k: int, sides: tuple[str, str]) -> None:
    record = tmp_path / "turns.jsonl"
    chosen = ["--sides", ",".join(sides)] if sides != ("bare", "harness") else []
    ablated = ["--ablate", "sampler,ledger"] if "ablated" in sides else []
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "observer_effect.py"), "--model", "cpu3m",
                        "--trainers", trainer, "--steps", str(steps), "--from", str(first), "--turns", str(k),
                        "--repeats", "2", "--record", str(record), *chosen, *ablated], capture_output=True, text=True,
                       cwd=REPO, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    head, *repeats = (json.loads(line) for line in record.read_text().splitlines())
    assert head["plan"]["--turns"] == k and len(repeats) == 2
    for r in repeats:
        rates = r["data"]["rates"][trainer]
        assert set(rates) == {*sides, *(f"{side} reported" for side in sides if side not in observer_sides.BARE_SIDES)}
        assert all(v > 0 for v in rates.values())
        # the harness's own figure is its step events' time less its waits: near the rate timed outside
        for side in (s for s in sides if s not in observer_sides.BARE_SIDES):
            assert rates[f"{side} reported"] == pytest.approx(rates[side], rel=0.1)
        # each side waited through the other's turns inside its window, and its rate leaves them out: of
        # its steps - first steps in turns of k, the side first in turn waits between its turns, the other
        # before its first too (each of the other's turns at about its own speed)
        turns = -(-(steps - first) // k)
        low, high = ((n * k) / (steps - first + n * k) for n in (turns - 1, turns))
        for side, (window, waited) in r["data"]["turns"][trainer].items():
            assert 0.5 * low < waited / window < 1.5 * high, (side, window, waited, low, high)
        # the sides train alike: a side off by a factor (its tokens counted twice, another window) lies
        # outside; a turn of 2 steps that other tests' ranks slow moved a side by up to 45 % in --all
        assert 0.55 < rates[sides[1]] / rates[sides[0]] < 1.8
        assert {side: len(rows) for side, rows in r["data"]["split"].items()} == dict.fromkeys(
            sides, 1 if trainer == "script" else 0)
        # the script's own seconds in each step of the window, kept for the report's own-step table
        assert {side: len(v) for side, v in r["data"].get("own", {}).items()} == (
            dict.fromkeys(sides, steps - first) if trainer == "script" else {})
        assert all(0 < v < 60 for v in r["data"].get("own", {}).get(sides[0], []))
    assert f"taking turns {k} steps at a time" in p.stdout
    for r in repeats:  # when the turns began, and each side's first step and end, s from the launch
        t = r["data"]["timeline"][trainer]
        assert 0 < t["turns_s"] < max(t["ended_s"].values()) and set(t["first_mark"]) == set(sides)
        # each side's first marked step (step 1: bare mlx-lm marks every step too) came before the turns
        assert all(0 < t["first_mark"][side][1] <= t["turns_s"] + 0.05 for side in sides)
        assert {side: t["first_mark"][side][0] for side in sides} == dict.fromkeys(sides, 1)
        # each side's last step was done after the turns began and before the side ended
        assert all(t["turns_s"] < t["last_mark"][side] <= t["ended_s"][side] + 0.05 for side in sides)
    assert f"{trainer}, a repeat's timeline (medians of 2, s from launch): the last side ended at " in p.stdout
    assert re.search(rf"; {sides[0]}: its step 1 done at [\d.]+, its last at [\d.]+, ended at", p.stdout), p.stdout
    if trainer == "script":  # the own step's ratio over the repeats, and its mean by the step's place in a turn
        assert re.search(rf"{sides[0]} / {sides[1]} +2 +\d\.\d{{4}} \[", p.stdout), p.stdout[-1500:]
        assert f"own ms, step {k} of a turn" in p.stdout and f"own ms, step {k + 1} of" not in p.stdout


def test_mlx_lms_side_reporting_every_step_is_refused_with_another_trainer_in_one_line() -> None:
    for trainers in ("script,mlx_lm", "mlx_vlm"):
        cmd = [sys.executable, str(REPO / "benchmarks" / "observer_effect.py"), "--trainers", trainers,
               "--sides", "harness,bare_every_step"]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
        assert p.returncode == 1 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.startswith("--sides: bare_every_step is mlx-lm's alone"), p.stderr
    # its ratios: the harness apart from mlx-lm's own reporting, and that reporting apart from bare
    assert observer_effect.comparisons(["harness", "bare_every_step", "bare"]) == [
        ("harness", "bare"), ("harness", "bare_every_step"), ("bare_every_step", "bare")]


def test_turning_off_a_cpus_blas_is_noted_as_measuring_the_blas() -> None:
    note = observer_effect.blas_note("cpu: AMD EPYC", ["env", "preload", "sampler"])
    assert note.startswith("note: on a CPU, env and preload off") and "measures the BLAS" in note
    assert observer_effect.blas_note("cpu: AMD EPYC", ["sampler", "ledger"]) is None
    assert observer_effect.blas_note("cuda: NVIDIA H200", ["env", "preload"]) is None  # no BLAS on a GPU's path
    assert observer_effect.blas_note(None, ["preload"]) is None  # a report runs nothing


def test_bare_mlx_lms_clock_counts_each_steps_tokens_and_refuses_a_count_mlx_lm_did_not_report() -> None:
    import bare_trainers
    import numpy as np

    clock = bare_trainers.FetchClock(3)
    # rows of (offset, length): default_loss counts targets 1..width-1 from each row's offset to its length
    clock.batches = [(np.array([[0, 4], [2, 4]]), 5), (np.array([[1, 3]]), 5), (np.array([[0, 2]]), 3)]
    clock.marks = [{"step": s, "time": float(s)} for s in (1, 2, 3)]
    clock.reported = {3: 12}
    assert [m["tokens"] for m in clock.counted()] == [4 + 3, 7 + 3, 10 + 2]
    clock.reported = {2: 10, 3: 13}
    with pytest.raises(SystemExit, match="bare mlx-lm: 12 supervised tokens counted by step 3, mlx-lm reported 13"):
        clock.counted()


def test_bare_mlx_lms_clock_marks_each_step_once_before_the_next_batch_is_built(monkeypatch) -> None:
    import bare_trainers
    import mlx_lm.tuner.trainer as mlx_lm_trainer
    import numpy as np

    log: list[tuple[str, int]] = []

    def batches(dataset: list[int], loop: bool = False, **_: object):  # mlx-lm's, as its loop draws them
        for i in dataset:
            log.append(("built", i))
            yield np.zeros((1, 3)), np.array([[0, 2]])

    monkeypatch.setattr(mlx_lm_trainer, "iterate_batches", batches)
    clock = bare_trainers.FetchClock(3)
    monkeypatch.setattr(clock, "mark", lambda step: log.append(("marked", step)))
    report = clock.callback(object)
    for it, _ in zip(range(1, 4), clock.iterate_batches(dataset=[1, 2, 3, 4], loop=True), strict=False):  # train()'s
        log.append(("trained", it))
        report.on_train_loss_report({"iteration": it, "trained_tokens": 2 * it})  # every step reported
    assert log == [("built", 1), ("trained", 1), ("marked", 1), ("built", 2), ("trained", 2), ("marked", 2),
                   ("built", 3), ("trained", 3), ("marked", 3)]
    assert len(clock.batches) == 3 and clock.reported == {1: 2, 2: 4, 3: 6}
    log.clear()  # an evaluation's batches pass unmarked and uncounted
    assert len(list(clock.iterate_batches(dataset=[1, 2], loop=False))) == 2 and ("marked", 1) not in log
    assert len(clock.batches) == 3


@pytest.mark.parametrize(("trainer", "torch"), [("mlx_lm", "hidden"), ("mlx_vlm", "hidden"), ("script", "absent"),
                                               ("unsloth_zoo", "absent")])
def test_a_bare_side_hides_what_its_trainers_rank_hides(tmp_path: Path, trainer: str, torch: str) -> None:
    # the bare side's process, its trainer replaced by a probe of what it would import torch as
    script = str(REPO / "benchmarks" / "observer_effect.py")
    code = (f"import sys; sys.argv = ['observer_effect.py', '--bare', 'x.toml', {trainer!r}, 'out.json']\n"
            f"import importlib.util as u\n"
            f"spec = u.spec_from_file_location('observer_effect', {script!r})\n"
            f"m = u.module_from_spec(spec); spec.loader.exec_module(m)\n"
            f"m.BARE[{trainer!r}] = lambda *a, **k: print('absent' if 'torch' not in sys.modules else 'hidden' "
            f"if sys.modules['torch'] is None else 'imported')\n"
            f"m.main()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == torch, p.stdout + p.stderr[-2000:]
