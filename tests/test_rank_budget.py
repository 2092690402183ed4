"""The machine-wide rank budget: slots held across processes (pure file locks), and under
pytest-xdist with real ranks, never more ranks alive at once than the budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.controller import rank_budget
from harness.controller.cpu_use import speed_disturbed
from harness.controller.rank_budget import Neighbours
from tests.conftest import write_scenario

HOLDER = """
import sys, time
from harness.controller import rank_budget
slots = rank_budget.hold(int(sys.argv[1]), *sys.argv[3:4])
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _env(tmp_path: Path, size: int) -> dict[str, str]:
    return {**os.environ, rank_budget.DIR_VAR: str(tmp_path / "slots"), rank_budget.BUDGET_VAR: str(size)}


def test_a_launch_waits_while_another_process_holds_the_slots_it_needs(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    env = _env(tmp_path, 2)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "2", "1.5"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        t0 = time.monotonic()
        slots = rank_budget.hold(1)  # both slots are taken: this waits for the holder to end
        waited = time.monotonic() - t0
        assert waited > 0.8 and slots.waited_s > 0.8
        slots.release()
    finally:
        holder.wait(timeout=10)


STREAM = """
import sys, time
from harness.controller import rank_budget
end = time.monotonic() + float(sys.argv[1])
print("streaming", flush=True)
while time.monotonic() < end:  # 1-rank launches back to back, as a worker's floor runs are
    slots = rank_budget.hold(1, "a stream")
    time.sleep(0.03)
    slots.release()
"""


def test_a_wide_launch_waits_its_turn_not_for_a_stream_of_narrow_ones_to_end(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Two processes each take 1 of 2 slots back to back for 8 s; a launch of 2 ranks that starts
    waiting among them gets both within its turn (the narrow ones queue behind it once it waits),
    not after the stream: without turns, it waited for all of it."""
    env = _env(tmp_path, 2)
    streams = [subprocess.Popen([sys.executable, "-c", STREAM, "8"], env=env, stdout=subprocess.PIPE, text=True)
               for _ in range(2)]
    try:
        assert [s.stdout.readline().strip() for s in streams] == ["streaming"] * 2
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        time.sleep(0.5)
        slots = rank_budget.hold(2, "a wide launch")
        assert slots.waited_s < 2.0, slots.waited_s
        assert all(s.poll() is None for s in streams)  # the streams were still going
        assert not list((tmp_path / "slots").glob(f"{rank_budget.QUEUE_PREFIX}*-{os.getpid()}"))  # its ticket went
        slots.release()
    finally:
        for s in streams:
            s.wait(timeout=20)
    assert not list((tmp_path / "slots").glob(f"{rank_budget.QUEUE_PREFIX}*"))  # every ticket gone at the end


def test_a_waiting_launch_says_who_holds_the_slots(tmp_path: Path, monkeypatch, capsys) -> None:  # noqa: ANN001
    env = _env(tmp_path, 2)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "2", "1.0", "run 'ddp2'"], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(rank_budget, "NOTICE_AFTER_S", 0.2)
        rank_budget.hold(1, "test x.py::y").release()
    finally:
        holder.wait(timeout=10)
    err = capsys.readouterr().err
    assert err.strip() == (f"test x.py::y: waiting for 1 of this machine's 2 rank slots ({rank_budget.BUDGET_VAR}); "
                           f"held: 2 by run 'ddp2' (pid {holder.pid})")


def test_a_launch_wider_than_the_budget_takes_the_whole_budget_and_a_dead_holder_frees_its_slots(
        tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    for k, v in _env(tmp_path, 2).items():
        monkeypatch.setenv(k, v)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "1", "60"], env=dict(os.environ),
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()  # its slot is free once the process is gone, without any release
    holder.wait(timeout=10)
    slots = rank_budget.hold(4)  # 4 ranks on a budget of 2: all of it
    assert len(slots.held) == 2 and slots.waited_s < 1.0
    slots.release()


def test_a_bad_budget_is_a_one_line_error_naming_the_variable(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv(rank_budget.BUDGET_VAR, "lots")
    with pytest.raises(ValueError, match=r"MLX_DDP_HARNESS_RANK_BUDGET='lots': the rank budget must be"):
        rank_budget.budget()
    monkeypatch.setenv(rank_budget.BUDGET_VAR, "")
    assert rank_budget.budget() == (os.cpu_count() or 1)


def _rank_intervals(out: Path) -> list[tuple[float, float]]:
    spans = []
    for f in out.rglob("rank*.events.jsonl"):
        times = {}
        for line in f.read_text().splitlines():
            e = json.loads(line)
            if e["kind"] in ("start", "end"):
                times[e["kind"]] = e["time"]
        if len(times) == 2:
            spans.append((times["start"], times["end"]))
    return spans


def _most_at_once(spans: list[tuple[float, float]]) -> int:
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    alive = most = 0
    for _, d in edges:
        alive += d
        most = max(most, alive)
    return most


@pytest.mark.ranks
@pytest.mark.full  # the budget between processes: the tests above, in every session
def test_xdist_workers_never_run_more_ranks_at_once_than_the_budget(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    for name in ("a", "b", "c"):
        path = write_scenario(suite, name, (1, 2), steps=6)
        path.write_text(path.read_text().replace("seed = 7\n", "seed = 7\ndefault = true\n", 1))
    out = tmp_path / "out"
    env = {k: v for k, v in _env(tmp_path, 2).items() if not k.startswith("PYTEST_")}
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "3", "suite",
                        "--mlx-ddp-out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    spans = _rank_intervals(out)
    assert len(spans) >= 3 * (1 + 2 + 1)  # single, ddp2 and its floor run, in each scenario
    assert _most_at_once(spans) <= 2


def test_a_run_counts_the_other_launches_beside_it_and_not_its_own_slots(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    for k, v in _env(tmp_path, 3).items():
        monkeypatch.setenv(k, v)
    mine = rank_budget.hold(1, "run 'mine'")
    mine_file = Path(mine.held[0].name)
    meter = rank_budget.NeighbourMeter(mine)
    meter.poll()  # alone: its own slot is not a neighbour
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "2", "60", "run 'other'"], env=dict(os.environ),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for _ in range(3):
            meter.last = 0.0
            meter.poll()
    finally:
        holder.kill()  # gone without releasing: its slot files still name it, but it is dead
        holder.wait(timeout=10)
    meter.last = 0.0
    meter.poll()
    mine.release()
    seen = meter.stop()
    assert (seen.samples, seen.shared, seen.most) == (5, 3, 2) and seen.crowded()  # beside it for 3 of 5 samples
    assert seen.describe() == "other launches held rank slots for 60% of it (up to 2 at once)"
    assert mine_file.read_text() == ""  # a released slot names no holder
    assert rank_budget.others_holding(rank_budget.RankSlots(), {os.getpid()}) == 0


@pytest.mark.ranks
def test_a_run_beside_another_launch_records_it(tmp_path: Path) -> None:
    write_scenario(tmp_path, "beside", (1,), steps=4)
    env = {k: v for k, v in _env(tmp_path, 4).items() if not k.startswith("PYTEST_")}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "2", "600", "run 'other'"], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        p = subprocess.run([sys.executable, "-m", "harness", "run", str(tmp_path / "beside.toml"), "--out",
                            str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert p.returncode == 0, p.stdout + p.stderr
    run = json.loads((tmp_path / "out" / "result.json").read_text())["scenarios"][0]["runs"][0]
    near = run["neighbours"]
    assert near["samples"] >= 1 and near["shared"] == near["samples"] and near["most"] == 2
    # on the CPU the rank budget keeps launches apart: a neighbour is not a disturbance (busy CPUs, which
    # parallel tests may cause, are judged apart and may still mark the run)
    assert "other launches held rank slots" not in p.stdout
    assert speed_disturbed(1, None, Neighbours(near["samples"], near["shared"], near["most"]), None) is None
