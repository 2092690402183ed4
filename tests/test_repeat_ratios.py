"""The observer-effect benchmark's ratios (``benchmarks/repeat_ratios.py``) and the switches that
turn a rank's parts off for it alone (``harness.ablation``)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from scipy.stats import t

from harness import ablation
from harness.rank.models import START_ABLATED
from tests.conftest import REPO, cli, write_scenario

_spec = importlib.util.spec_from_file_location("repeat_ratios", REPO / "benchmarks" / "repeat_ratios.py")
repeat_ratios = importlib.util.module_from_spec(_spec)
sys.modules["repeat_ratios"] = repeat_ratios  # its dataclass looks its module up there
_spec.loader.exec_module(repeat_ratios)
Ratios = repeat_ratios.Ratios
_spec = importlib.util.spec_from_file_location("repeat_record", REPO / "benchmarks" / "repeat_record.py")
repeat_record = importlib.util.module_from_spec(_spec)
sys.modules["repeat_record"] = repeat_record
_spec.loader.exec_module(repeat_record)
_spec = importlib.util.spec_from_file_location("timed_script", REPO / "benchmarks" / "timed_script.py")
timed_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timed_script)
_spec = importlib.util.spec_from_file_location("gpu_clocks", REPO / "benchmarks" / "gpu_clocks.py")
gpu_clocks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_clocks)


def test_the_interval_is_students_over_the_repeats() -> None:
    r = Ratios((0.95, 0.97, 0.96, 0.98))
    lo, hi = r.interval()
    half = t.ppf(0.975, 3) * statistics.stdev(r.values) / 2
    assert r.mean == pytest.approx(0.965) and (lo, hi) == pytest.approx((0.965 - half, 0.965 + half))


def test_an_interval_resolves_only_when_it_lies_wholly_on_one_side_of_a_two_percent_cost() -> None:
    # the H200's script, two repeats: 0.946 and 0.900: far too wide
    wide = Ratios((0.946, 0.900))
    assert not wide.resolved() and wide.verdict().startswith("too wide to tell a 2% effect from none (at this mean")
    level = Ratios((0.995, 1.004, 0.999, 1.002, 0.998))  # tight around 1: at most a 2 % cost
    assert level.resolved() and level.interval()[0] > 0.98 and level.verdict() == "at most a 2% cost"
    slower = Ratios((0.95, 0.955, 0.948, 0.952))  # tight below 0.98: a cost
    assert slower.resolved() and slower.interval()[1] < 0.98
    assert slower.verdict().startswith("a cost of more than 2% (4.")
    # the H200's script against bare at 16 repeats: below 1, but reaching past 0.98: a cost, not yet
    # told from 2 %, so repeats go on
    costs = Ratios((0.989, 0.982, 0.990, 0.995, 0.976, 1.003, 1.010, 0.985, 1.008, 0.999, 0.981, 0.993, 0.964,
                    0.987, 0.966, 0.995), repeat_ratios.look_level(9))
    lo, hi = costs.interval()
    assert lo < 0.98 < hi < 1 and not costs.resolved()
    assert costs.verdict().startswith(f"a cost of {1 - hi:.1%} to {1 - lo:.1%}, not yet told from 2% (at this mean")
    within = Ratios((0.990, 0.988, 0.991, 0.989, 0.990))  # below 1 and above 0.98: a cost within 2 %
    assert within.resolved() and 0.98 < within.interval()[0] and within.interval()[1] < 1
    assert within.verdict() == "at most a 2% cost"
    faster = Ratios((1.03, 1.031, 1.029))
    assert faster.resolved() and faster.verdict() == "no cost"
    one = Ratios((0.99,))
    assert not one.resolved() and one.verdict() == "one repeat: no interval" and one.cell() == "0.990 (1 repeat)"


def test_an_unresolved_verdict_says_how_many_repeats_would_resolve_it_at_this_mean_and_spread() -> None:
    # the bfloat16 script's first 30 repeats on an H200 (their record), at one look of 17
    r = Ratios((0.982, 1.028, 0.923, 0.965, 1.056, 0.954, 0.977, 0.977, 0.950, 0.940, 0.978, 1.013, 0.976,
                1.055, 0.947, 1.012, 0.883, 0.988, 1.026, 0.959, 1.068, 1.013, 1.027, 0.988, 0.923, 0.994,
                1.018, 0.978, 1.048, 1.030), repeat_ratios.look_level(17))
    need = r.repeats_to_resolve()
    room = abs(r.mean - 0.98)  # the half-width must fall under it

    def half(k: int) -> float:
        return t.ppf(0.5 + r.level / 2, k - 1) * statistics.stdev(r.values) / k ** 0.5

    assert half(need) < room <= half(need - 1) and 100 < need < 250  # the fewest that would
    assert r.verdict() == ("too wide to tell a 2% effect from none "
                           f"(at this mean and spread, about {need} repeats would)")
    assert Ratios((0.99,)).repeats_to_resolve() is None and r.repeats_to_resolve(most=100) is None
    resolved = Ratios((0.995, 1.004, 0.999, 1.002, 0.998))
    assert resolved.repeats_to_resolve() == 5  # it resolves as it is


def test_the_intervals_are_looked_at_after_whole_rotations_at_a_level_that_holds_over_the_looks() -> None:
    assert repeat_ratios.looks(3, 3, 2) == [4]  # two sides: each first twice
    assert repeat_ratios.looks(3, 8, 3) == [3, 6, 9]
    assert repeat_ratios.looks(4, 2, 1) == [4]  # a limit below the first look: the first look
    assert repeat_ratios.looks(12, 64, 1, 12) == [12, 24, 36, 48, 60, 64]  # --look-every: the last at the limit
    assert repeat_ratios.looks(16, 32, 2, 5) == [16, 22, 28, 32]  # every 5 rounded up to whole rotations
    assert repeat_ratios.looks(3, 8, 3, 1) == repeat_ratios.looks(3, 8, 3)  # no fewer than one rotation apart
    # fewer looks, a narrower interval at each: the reference's compiled step resolves sooner
    ratios = (1.006, 0.973, 0.983, 0.978, 1.036, 0.988, 0.976, 0.974, 0.986, 1.019, 0.955, 0.989, 0.980, 0.985,
              0.992, 0.971, 1.041, 0.996, 0.969)
    every = Ratios(ratios, repeat_ratios.look_level(len(repeat_ratios.looks(12, 64, 1))))
    few = Ratios(ratios, repeat_ratios.look_level(len(repeat_ratios.looks(12, 64, 1, 12))))
    assert few.repeats_to_resolve() < every.repeats_to_resolve()
    assert repeat_ratios.look_level(1) == pytest.approx(0.95) and repeat_ratios.look_level(5) == pytest.approx(0.99)
    tighter = Ratios((0.95, 0.97, 0.96, 0.98), repeat_ratios.look_level(5))
    assert tighter.interval()[0] < Ratios(tighter.values).interval()[0]  # wider at each of five looks


def test_a_record_carries_one_plans_repeats_over_invocations_and_refuses_another_plan(tmp_path: Path) -> None:
    path, plan = tmp_path / "script.jsonl", {"device": "cuda: NVIDIA H200", "--steps": 40, "--repeats (looks)": [20]}
    first = repeat_record.RepeatRecord.open(path, "observer_effect", plan, where="gpu-a")
    first.add({"rates": {"bare": 100.0, "harness": 99.0}})
    lines = path.read_text().splitlines()
    first.add({"rates": {"bare": 101.0, "harness": 101.5}})
    again = repeat_record.RepeatRecord.open(path, "observer_effect", plan, where="gpu-b")  # a later invocation
    assert again.data() == first.data() and [r["repeat"] for r in again.repeats] == [1, 2]
    again.add({"rates": {"bare": 98.0, "harness": 97.0}})
    third = repeat_record.RepeatRecord.open(path, "observer_effect", plan)
    assert len(third.repeats) == 3 and [r["where"] for r in third.repeats] == ["gpu-a", "gpu-a", "gpu-b"]
    assert third.provenance().startswith("3 repeats, ") and "2 on gpu-a" in third.provenance()
    assert "1 on gpu-b" in third.provenance()
    with pytest.raises(SystemExit, match=r"run with --steps 40, this invocation has 30; continue it with the same"):
        repeat_record.RepeatRecord.open(path, "observer_effect", {**plan, "--steps": 30})
    with pytest.raises(SystemExit, match=r"run with device 'cuda: NVIDIA H200', this invocation has 'cuda: NVIDIA H1"):
        repeat_record.RepeatRecord.open(path, "observer_effect", {**plan, "device": "cuda: NVIDIA H100 80GB HBM3"})
    with pytest.raises(SystemExit, match="a record of 'observer_effect' version 1, not of 'step_vs_mlx_lm'"):
        repeat_record.RepeatRecord.open(path, "step_vs_mlx_lm", plan)
    for text, why in (("not json\n", "not a repeat record"), ("[1]\n", "its first line names no plan"),
                      (lines[0] + '\n{"data": {}}\n', "line 2 is not a repeat")):
        (bad := tmp_path / "bad.jsonl").write_text(text)
        with pytest.raises(SystemExit, match=f"bad.jsonl: .*{why}"):
            repeat_record.RepeatRecord.open(bad, "observer_effect", plan)
    with pytest.raises(SystemExit, match="a folder; --record takes a file"):
        repeat_record.RepeatRecord.open(tmp_path, "observer_effect", plan)
    with pytest.raises(SystemExit, match="its folder .* does not exist"):
        repeat_record.RepeatRecord.open(tmp_path / "no" / "r.jsonl", "observer_effect", plan)
    assert repeat_record.RepeatRecord.open(None, "observer_effect", plan).repeats == []  # kept in memory only
    assert len(path.read_text().splitlines()) == 4  # its head and three repeats: nothing rewritten
    with open(path, "a") as f:
        f.write('{"repeat": 4, "where"')  # a write stopped part way
    cut = repeat_record.RepeatRecord.open(path, "observer_effect", plan)
    assert len(cut.repeats) == 3 and path.read_text().endswith("}\n")  # that line dropped, the rest kept
    cut.add({"rates": {"bare": 99.0, "harness": 99.0}})
    assert len(repeat_record.RepeatRecord.open(path, "observer_effect", plan).repeats) == 4


def test_a_time_limit_starts_no_repeat_that_would_end_past_it(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(repeat_record.time, "monotonic", lambda: clock[0])
    limit = repeat_record.TimeLimit(300, started=100.0)
    assert limit.room()  # the first repeat always starts
    clock[0] += 90
    assert limit.room() and limit.longest == 90  # 190 + 90 <= 400
    clock[0] += 70
    assert limit.room() and limit.longest == 90  # 260 + 90 <= 400: judged by the longest
    clock[0] += 95
    assert not limit.room() and limit.longest == 95  # 355 + 95 > 400
    unlimited = repeat_record.TimeLimit(None)
    assert unlimited.room() and unlimited.room()


def test_the_parts_a_benchmark_turns_off_are_named_and_checked() -> None:
    assert ablation.ablated({}) == frozenset()
    assert ablation.ablated({ablation.VAR: "sampler, ledger"}) == {"sampler", "ledger"}
    with pytest.raises(ablation.AblationError, match="no part named samplr"):
        ablation.ablated({ablation.VAR: "samplr"}, strict=True)
    assert ablation.ablated({ablation.VAR: "samplr,ledger"}) == {"ledger"}  # a rank turns off what it knows


@pytest.mark.parametrize("command", [["run", "scenarios/text_parity.toml"], ["soak"]])
def test_no_verdict_is_given_with_a_part_turned_off(command: list[str]) -> None:
    p = cli(*command, env={ablation.VAR: "sampler"})
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"error: {ablation.VAR} is set (sampler): it turns parts of every rank off"), p.stderr


@pytest.mark.ranks
def test_a_rank_with_every_part_turned_off_trains_and_says_what_was_off(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from harness import schema
    from harness.controller.run_job import execute
    from harness.scenario import load_scenario
    from harness.scenario.plan import job_for

    job = job_for(load_scenario(write_scenario(tmp_path, "parts", steps=3)), "single")  # its start compared
    whole = execute("whole", job, 1, keep_to=tmp_path / "whole")
    monkeypatch.setenv(ablation.VAR, ",".join(ablation.PARTS))
    bare = execute("bare", job, 1, keep_to=tmp_path / "bare")
    assert whole.ok and bare.ok, (whole.failure, bare.failure)
    assert "ablated" not in whole.result(0) and bare.result(0)["ablated"] == sorted(ablation.PARTS)
    assert "memory_share" in whole.result(0) and "memory_share" not in bare.result(0)
    assert schema.ledger_path(tmp_path / "whole", 0).exists() and not schema.ledger_path(tmp_path / "bare", 0).exists()
    assert bare.result(0)["digests"]["0"] == START_ABLATED != whole.result(0)["digests"]["0"]  # no host read at start
    steps = [e for e in bare.ranks[0].events if e.get("kind") == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3]  # its steps are still reported: the benchmark times them
    whole_lines = schema.ledger_path(tmp_path / "whole", 0).read_text().splitlines()
    whole_steps = {e["step"] for e in map(json.loads, whole_lines)}
    assert {1, 2, 3} <= whole_steps, whole_steps  # the run's collectives, step by step
    # the sampler in steps 1-2, not in 3; the ledger records in steps 1 and 3, not in 2 (alternating_part.py)
    monkeypatch.setenv(ablation.VAR, "sampler/2,ledger/1")
    alternating = execute("alternating", job, 1, keep_to=tmp_path / "alternating")
    assert alternating.ok, alternating.failure
    assert alternating.result(0)["alternated"] == {"sampler": 2, "ledger": 1}
    assert "ablated" not in alternating.result(0) and alternating.result(0)["memory_sampler_error"] is None
    lines = map(json.loads, schema.ledger_path(tmp_path / "alternating", 0).read_text().splitlines())
    assert {e["step"] for e in lines if e["step"] >= 1} == {1, 3} & whole_steps


@pytest.mark.full  # a benchmark, run small: both sides, their ratio, and a record continued
@pytest.mark.ranks
def test_the_observer_benchmark_runs_both_sides_and_continues_its_record(tmp_path: Path) -> None:
    record = tmp_path / "script.jsonl"

    tools = tmp_path / "bin"  # an nvidia-smi that reads a steady GPU, for the first invocation
    tools.mkdir()
    (tools / "nvidia-smi").write_text(  # it answers only the command line the sampler should give
        "#!/bin/sh\n[ \"$*\" = '--id=0 --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu "
        "--format=csv,noheader,nounits --loop-ms=200' ] || exit 3\n"
        "while true; do echo \"$(date '+%Y/%m/%d %H:%M:%S.%3N'), 1410, 250.5, 51\"; sleep 0.05; done\n")
    (tools / "nvidia-smi").chmod(0o755)

    def observe(*extra: str, path: str = os.environ["PATH"]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "benchmarks" / "observer_effect.py"), "--model", "cpu3m",
                               "--trainers", "script", "--steps", "6", "--from", "2", "--record", str(record),
                               *extra], capture_output=True, text=True, cwd=REPO, timeout=600,
                              env={**os.environ, "PATH": path})

    first = observe("--repeats", "2", path=f"{tools}{os.pathsep}{os.environ['PATH']}")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    lines = record.read_text().splitlines()
    assert len(lines) == 3  # its plan and two repeats, the second with the harness first
    rates = [json.loads(line)["data"]["rates"]["script"] for line in lines[1:]]
    assert list(rates[0]) == ["bare", "harness", "harness reported"] and list(rates[1])[0] == "harness"
    assert all(v > 0 for r in rates for v in r.values())  # the bare side (--bare, a process of its own) timed too
    row = next(line for line in first.stdout.splitlines() if line.startswith("script     harness / bare"))
    ratios = [rates[i]["harness"] / rates[i]["bare"] for i in range(2)]
    assert f"{ratios[0]:.3f}, {ratios[1]:.3f}" in row and f"{sum(ratios) / 2:.3f} [" in row
    assert re.search(r"own, median +node +steps there", first.stdout)  # the script's split, with where its steps ran
    split = [json.loads(line)["data"]["split"] for line in lines[1:]]
    assert all(r[-3:] == [1410.0, 250.5, 51.0] for s in split for side in s.values() for r in side)  # the GPU's
    assert "GPU SM MHz" in first.stdout and "GPU max C" in first.stdout and "1410, 1410" in first.stdout
    again = observe("--repeats", "2")  # a later invocation: the two repeats are all the plan asks for
    assert again.returncode == 0 and "continuing" in again.stderr and row in again.stdout
    other = observe("--repeats", "4")
    assert other.returncode == 1 and other.stderr.count("\n") == 1 and "Traceback" not in other.stderr
    assert "were run with --repeats/--max-repeats (looks after) [2], this invocation has [4]" in other.stderr
    assert record.read_text().splitlines() == lines  # nothing already written is lost


@pytest.mark.parametrize(("args", "line"), [
    (["--sides", "harness"],
     "--sides: two or three of bare, harness, ablated, bare_every_step, each once; got 'harness'"),
    (["--sides", "harness,ablated"], "--sides: the ablated side needs --ablate PARTS (the parts it turns off)"),
    (["--trainers", "mlx_lm", "--ablate", "sampler", "--sides", "bare,harness,ablated,bare_every_step"],
     "--sides: two or three of bare, harness, ablated, bare_every_step, each once; got "
     "'bare,harness,ablated,bare_every_step'"),
    (["--ablate", "sampler", "--sides", "bare,harness"], "--ablate runs the ablated side: add it to --sides"),
    (["--time-limit", "60"], "--time-limit stops before the plan's repeats are done: give --record FILE to keep them"),
    (["--report-only"], "--report-only reports a record: --record FILE is not one"),
    (["--report-only", "--record", "no.jsonl"], "--report-only reports a record: no.jsonl is not one"),
    (["--look-every", "0"], "--look-every 0: a number of repeats, 1 or more"),
])
def test_the_observer_benchmarks_bad_options_are_one_line(args: list[str], line: str) -> None:
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "observer_effect.py"), *args], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert p.returncode == 1 and p.stderr == line + "\n", p.stderr


def test_the_gpus_readings_are_summed_up_over_a_timed_window_alone() -> None:
    at = datetime(2026, 12, 3, 9, 29, 44, 125000).timestamp()  # nvidia-smi prints local time
    assert gpu_clocks.reading("2026/12/03 09:29:44.125, 1980, 612.31, 47\n") == (at, [1980.0, 612.31, 47.0])
    assert gpu_clocks.reading("2026/12/03 09:29:44, 1980, [N/A], 47") == (at - 0.125, [1980.0, None, 47.0])
    assert gpu_clocks.reading("2026/12/03 09:29:44.125, [N/A], [N/A], [N/A]") is None
    assert gpu_clocks.reading("No devices were found") is None and gpu_clocks.reading("1980, 600, 40, 1") is None
    samples = [(0.5, [900.0, 100.0, 40.0]), (1.0, [1900.0, 500.0, 60.0]), (2.0, [1700.0, None, 62.0]),
               (3.5, [800.0, 90.0, 70.0])]
    assert gpu_clocks.summary(samples, 1.0, 3.0) == [1800.0, 500.0, 62.0]  # the window's readings, no others
    assert gpu_clocks.summary(samples, 5.0, 6.0) == []  # none read in it
    assert gpu_clocks.summary([(1.0, [None, None, 50.0])], 0.0, 2.0) == []  # no clock: nothing said after it
    with gpu_clocks.GpuClocks(tool="no-such-tool-here") as g:  # a machine without nvidia-smi
        assert g.over(0.0, float("inf")) == []


def test_the_scripts_split_says_which_numa_node_its_steps_ran_on(monkeypatch: pytest.MonkeyPatch) -> None:
    assert timed_script.cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    monkeypatch.setattr(timed_script, "node_of", lambda cpu: cpu // 8)  # two nodes of 8 CPUs
    assert timed_script.placement([9, 12, 3, 15]) == (1, 0.75)
    assert timed_script.placement([-1, -1]) == (-1, 0.0)  # not known (off Linux)
    # rows: time, s in probe, s in step, s in gc, full collections, CPU; the window starts after step 2
    rows = [[0.0, 0, 0, 0, 0, 1], [1.0, 0, 0.1, 0, 0, 1], [2.0, 0, 0.2, 0, 0, 9], [3.0, 0, 0.3, 0, 0, 10]]
    split = timed_script.split({"rows": rows, "objects": 100}, 2)
    assert split[:2] == pytest.approx([0.9, 0.1]) and split[-2:] == [1, 1.0]  # steps 3 and 4 ended on CPUs 9 and 10
    old = timed_script.split({"rows": [r[:5] for r in rows], "objects": 100}, 2)  # a record's rows before the CPU
    assert len(old) == 6 and old[:2] == split[:2]


def test_the_scripts_own_steps_are_kept_and_told_apart_by_their_place_in_a_turn() -> None:
    # rows: time, s in probe, s in step, s in gc, full collections, CPU, s waiting for a turn
    rows = [[0.0, 0, 0, 0, 0, 1, 0], [1.0, 0, 0.1, 0, 0, 1, 0], [3.0, 0, 0.2, 0, 0, 1, 0.5],
            [4.0, 0.05, 0.3, 0, 0, 1, 0.5], [6.5, 0.05, 0.4, 0, 0, 1, 1.0]]
    own = timed_script.own_steps({"rows": rows}, 2)  # steps 3 to 5: less the calls and the waits
    assert own == pytest.approx([1.4, 0.85, 1.9])
    harness = [[0.102, 0.100, 0.102, 0.100], [0.104, 0.100, 0.104, 0.100]]
    bare = [[0.100, 0.100, 0.100, 0.100], [0.100, 0.100, 0.100, 0.100], []]  # a third repeat kept none
    table = timed_script.own_table({"harness": harness, "bare": bare}, ["harness", "bare"], 2, 0.95)
    assert re.search(r"harness / bare +2 +1\.0150 \[0\.9515, 1\.0785\]", table), table
    assert re.search(r"harness +103\.00 +100\.00\n", table + "\n") and "step 2 of a turn" in table
    assert "of a turn" not in timed_script.own_table({"harness": harness, "bare": bare[:2]}, ["harness", "bare"],
                                                     None, 0.95)
    assert timed_script.own_table({"harness": [[]], "bare": [[]]}, ["harness", "bare"], 2, 0.95) == ""


def test_a_numa_node_the_machine_lacks_is_refused_in_one_line() -> None:
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "observer_effect.py"), "--node", "999"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 1 and p.stderr.startswith("--node 999: this machine has no NUMA node 999 (")
    assert p.stderr.count("\n") == 1, p.stderr


@pytest.mark.parametrize(("args", "line"), [
    (["--block", "0"], "--block and --repeats must be at least 1, got 0 and 3"),
    (["--steps", "12", "--from", "8", "--block", "3"],
     "--steps 12 after --from 8 hold less than a block with the part and one without (3 steps each)"),
])
def test_the_alternating_benchmarks_bad_options_are_one_line(args: list[str], line: str) -> None:
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "alternating_part.py"), *args], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert p.returncode == 1 and p.stderr == line + "\n", p.stderr


def test_a_report_whose_reader_went_away_ends_quietly() -> None:
    code = ("import sys; sys.path.insert(0, 'benchmarks'); from repeat_record import quiet_pipe\n"
            "quiet_pipe(lambda: [print('x' * 1000, flush=True) for _ in range(10000)])")
    p = subprocess.run(f"{sys.executable} -c \"{code}\" | head -c 10 >/dev/null; echo \"${{PIPESTATUS[0]}}\"",
                       shell=True, executable="/bin/bash", capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.stdout == "0\n" and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


def test_a_record_is_reported_on_another_device_where_no_repeat_runs(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path, plan = tmp_path / "r.jsonl", {"device": "cuda: NVIDIA H200", "--steps": 40}
    repeat_record.RepeatRecord.open(path, "observer_effect", plan, where="gpu-a").add({"x": 1})
    here = {**plan, "device": "cpu: a laptop"}
    with pytest.raises(SystemExit, match="with device 'cuda: NVIDIA H200', this invocation has 'cpu: a laptop'"):
        repeat_record.RepeatRecord.open(path, "observer_effect", here)  # to continue it, the same device
    shown = repeat_record.RepeatRecord.open(path, "observer_effect", here, report_only=True)
    assert shown.plan["device"] == "cuda: NVIDIA H200" and shown.data() == [{"x": 1}]
    with pytest.raises(SystemExit, match="were run with --steps 40, this invocation has 30"):
        repeat_record.RepeatRecord.open(path, "observer_effect", {**here, "--steps": 30}, report_only=True)
    path.write_bytes(path.read_bytes() + b'{"repeat": 2, "whe')  # a repeat cut short while it was written
    before = path.read_bytes()
    assert len(repeat_record.RepeatRecord.open(path, "observer_effect", here, report_only=True).repeats) == 1
    assert path.read_bytes() == before  # a report writes nothing
    empty = tmp_path / "empty.jsonl"
    repeat_record.RepeatRecord.open(empty, "observer_effect", plan)  # its plan alone: its first repeat never ended
    with pytest.raises(SystemExit, match="empty.jsonl: no repeats yet: nothing to report"):
        repeat_record.RepeatRecord.open(empty, "observer_effect", here, report_only=True)
    with pytest.raises(SystemExit, match="--report-only reports a record: .*none.jsonl is not one"):
        repeat_record.RepeatRecord.open(tmp_path / "none.jsonl", "observer_effect", here, report_only=True)
    assert not (tmp_path / "none.jsonl").exists()
    limit = repeat_record.TimeLimit(None, report_only=True)
    assert not limit.room()  # no repeat starts
    limit.stopped(shown, 1, 12)
    assert "1 of at most 12 repeats in" in capsys.readouterr().err


def test_the_observer_reports_a_record_of_another_machine_without_running_a_side(tmp_path: Path) -> None:
    record = tmp_path / "gpu.jsonl"
    lines = (REPO / "benchmarks" / "records" / "observer-cpu3m-2cpu-vm.jsonl").read_text().splitlines()
    head = json.loads(lines[0])
    head["plan"].update({"device": "cuda: a GPU not here", "--node": 7})  # a node this machine lacks
    record.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    before = record.read_bytes()
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "observer_effect.py"), "--model", "cpu3m",
                        "--trainers", "mlx_lm,script,unsloth_zoo", "--steps", "30", "--from", "10", "--repeats", "20",
                        "--node", "7", "--record", str(record), "--report-only"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr.startswith(f"reporting {record}: 20 repeats") and "Traceback" not in p.stderr
    assert "script       harness / bare  1.004, 0.990, 1.013" in p.stdout and "1.000 [0.986, 1.015]" in p.stdout
    assert record.read_bytes() == before


def test_a_broken_pipe_that_is_not_the_reports_reader_is_raised() -> None:
    code = ("import sys; sys.path.insert(0, 'benchmarks'); from repeat_record import quiet_pipe\n"
            "def work():\n    print('a report line', flush=True)\n    raise BrokenPipeError('a pipe of its own work')\n"
            "quiet_pipe(work)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)  # read
    assert p.returncode == 1 and p.stdout == "a report line\n" and "BrokenPipeError: a pipe of its own work" in p.stderr


def test_a_repeat_names_the_commit_whose_code_it_ran_though_its_git_lags_behind(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "a.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "first")
    first = git("rev-parse", "--short", "HEAD")
    at_first = repeat_record.code_of(tmp_path)
    index = (tmp_path / ".git" / "index").read_bytes()
    (tmp_path / "harness" / "a.py").write_text("x = 2\n")  # a later commit's code, under the first's .git:
    (tmp_path / "harness" / "new.py").write_text("y = 1\n")  # a file changed and a file added
    (tmp_path / "notes.txt").write_text("not code\n")  # and something that is not code
    ran = repeat_record.code_of(tmp_path)
    assert ran not in (None, at_first) and (tmp_path / ".git" / "index").read_bytes() == index  # its index untouched
    rec = repeat_record.RepeatRecord("observer_effect", {}, repeats=[
        {"where": "vm", "commit": f"{first}+dirty", "code": ran, "at": "t0"},
        {"where": "vm", "commit": f"{first}+dirty", "at": "t1"}])  # a repeat from before fingerprints
    assert rec.provenance(tmp_path).endswith(f": 2 on vm ({first}+dirty)")  # no commit holds that code yet
    git("add", "harness")
    git("commit", "-qm", "second")
    second = git("rev-parse", "--short", "HEAD")
    git("commit", "-q", "--allow-empty", "-m", "third")  # the same code again: the first commit holding it
    said = rec.provenance(tmp_path)
    assert f"1 on vm ({first}+dirty: the code of {second}), 1 on vm ({first}+dirty)" in said
    assert repeat_record.code_of(tmp_path) == ran  # notes.txt is no part of it
    assert repeat_record.code_of(tmp_path / "no-such-folder") is None


def test_the_halves_of_each_window_tell_noise_within_a_run_from_noise_between_runs() -> None:
    # runs apart but each run's halves alike: the spread is between runs, and more steps leave it
    first, second = [0.96, 1.00, 0.98, 1.02, 0.97], [0.961, 0.999, 0.981, 1.019, 0.971]
    line = repeat_ratios.split_spread(first, second).line()
    spread = statistics.stdev([(a + b) / 2 for a, b in zip(first, second, strict=True)])
    within = statistics.stdev([a - b for a, b in zip(first, second, strict=True)]) / 2
    assert within < spread / 20
    assert line.startswith(f"spread {spread:.4f}, of it within a run {within:.4f} and between runs ")
    assert line.endswith(f"with twice the steps, about {(spread**2 - within**2 / 2) ** 0.5:.4f} (5 repeats' halves)")
    # halves noisier than the runs: all of the spread is within a run (the estimate held to the
    # whole), and twice the steps would bring it down to about 1 / sqrt(2) of it
    first, second = [0.98, 1.02, 0.99, 1.01, 0.985, 1.015], [1.02, 0.98, 1.01, 0.99, 1.015, 0.985]
    first, second = [a + 0.004 * k for k, a in enumerate(first)], [b + 0.004 * k for k, b in enumerate(second)]
    line = repeat_ratios.split_spread(first, second).line()
    spread = statistics.stdev([(a + b) / 2 for a, b in zip(first, second, strict=True)])
    within = statistics.stdev([a - b for a, b in zip(first, second, strict=True)]) / 2
    assert within > spread and f"of it within a run {spread:.4f} and between runs 0.0000" in line
    assert line.endswith(f"about {spread / 2 ** 0.5:.4f} (6 repeats' halves)")


def test_what_resolving_would_take_is_told_in_repeats_and_minutes_and_past_the_records_limit() -> None:
    # the reference's compiled step on an H200, its first 19 repeats, in a record looked at after
    # every repeat from 12 to 24 (13 looks)
    values = (1.006, 0.973, 0.983, 0.978, 1.036, 0.988, 0.976, 0.974, 0.986, 1.019, 0.955, 0.989, 0.980, 0.985,
              0.992, 0.971, 1.041, 0.996, 0.969)
    sd, room = statistics.stdev(values), abs(statistics.fmean(values) - 0.98)

    def resolves(k: int, n_looks: int) -> bool:  # at k repeats, in a plan of n_looks looks
        return t.ppf(0.5 + repeat_ratios.look_level(n_looks) / 2, k - 1) * sd / k ** 0.5 < room

    wide = repeat_ratios.looks(12, 100, 1)  # a record whose limit lies past what it needs
    r = Ratios(values, repeat_ratios.look_level(len(wide)))
    stop = next(k for k in wide if resolves(k, len(wide)))
    assert repeat_ratios.what_it_takes(r, wide, 1, 32.5) == (
        f"about {stop} repeats, at that look ({stop - 19} more, about {(stop - 19) * 32.5 / 60:.0f} min at 32.5 s a "
        "repeat)")
    # past this record's 24: a new record looking every 12 repeats, whose own looks set its level
    short = repeat_ratios.looks(12, 24, 1)
    r = Ratios(values, repeat_ratios.look_level(len(short)))
    most, stop = repeat_ratios.new_record(r.mean, sd, 12, 1)
    plan = repeat_ratios.looks(12, most, 1, 12)
    assert stop in plan and resolves(stop, len(plan)) and not any(resolves(k, len(plan)) for k in plan if k < stop)
    assert 24 < stop <= most < 2 * stop  # fewer than the 53 of looking after every repeat, and a plan no longer
    assert repeat_ratios.what_it_takes(r, short, 1, None) == (
        f"past this record's 24, a new record with --repeats 12 --max-repeats {most} --look-every 12: about {stop} "
        "repeats")
    # the runs' own spread small: twice the steps a repeat needs fewer repeats, each longer by the window
    spread = repeat_ratios.split_spread([1.00, 0.95, 1.02, 0.97, 0.99], [0.96, 1.01, 0.98, 1.00, 0.95])
    most2, stop2 = repeat_ratios.new_record(r.mean, sd * spread.doubled / spread.whole, 12, 1)
    assert stop2 < stop
    assert repeat_ratios.what_it_takes(r, short, 1, 32.0, spread, 6.0).endswith(
        f"; with twice the steps in the window, a new record with --repeats 12 --max-repeats {most2} --look-every "
        f"12: about "
        f"{stop2} repeats, about {stop2 * 38 / 60:.0f} min at 38.0 s a repeat")
    assert repeat_ratios.what_it_takes(Ratios((0.995, 1.004, 0.999, 1.002, 0.998)), short, 1, 32.0) is None


def test_a_records_seconds_a_repeat_are_its_own_or_else_the_gaps_between_its_repeats(tmp_path: Path) -> None:
    path, plan = tmp_path / "r.jsonl", {"--steps": 40}
    rec = repeat_record.RepeatRecord.open(path, "observer_effect", plan)
    rec.add({"run": "a"})
    rec.add({"run": "b"})
    assert all(isinstance(r["seconds"], float) and r["seconds"] >= 0 for r in rec.repeats)
    assert rec.seconds_per_repeat() == statistics.median(r["seconds"] for r in rec.repeats)
    assert rec.seconds_per_repeat(lambda d: d["run"] == "b") == rec.repeats[1]["seconds"]
    # repeats recorded before the seconds were: the median gap between finishing times, a pause
    # between two invocations passed over
    old = [{k: v for k, v in r.items() if k != "seconds"} for r in rec.repeats]
    stamps = ["2026-12-04T15:51:19Z", "2026-12-04T15:51:47Z", "2026-12-04T15:52:19Z", "2026-12-04T16:05:32Z",
              "2026-12-04T16:06:02Z"]
    rec.repeats = [{**old[0], "at": at} for at in stamps]
    assert rec.seconds_per_repeat() == 31.0  # gaps 28, 32, 793, 30
    rec.repeats = rec.repeats[:1]
    assert rec.seconds_per_repeat() is None


def test_the_step_benchmark_takes_each_repeats_steps_apart_in_halves() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from step_vs_mlx_lm import window_halves, window_seconds
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    def repeat(mine: list[float], bare: list[float]) -> list[tuple[float, dict]]:
        return [(0.0, {"tok_s_global": [1.0, *mine], "step_times_s": [9.0] + [0.1] * len(mine)}), None,
                (0.0, {"tok_s_global": [1.0, *bare], "step_times_s": [9.0] + [0.2] * len(bare)})]

    # the reference at the bare step in each repeat's first half, 10 % behind in its second
    def repeats(mine: list[float], bare: list[float]) -> list[list]:  # without mlx-lm's trainer: its list empty
        got = [list(g) for g in zip(*(repeat(mine, bare) for _ in range(3)), strict=True)]
        return [got[0], [], got[2]]

    got = repeats([100.0] * 8 + [90.0] * 8, [100.0] * 16)
    first, second = window_halves(got, 1)
    assert first == [1.0] * 3 and second == pytest.approx([0.9] * 3)
    assert window_seconds(got, 1) == pytest.approx(16 * 0.3)  # step 1 (the compile) left out
    assert window_halves([g[:2] for g in got], 1) is None  # under 3 repeats
    with_trainer = [got[0], got[0], got[2]]  # mlx-lm's trainer too: its steps lengthen the window
    assert window_seconds(with_trainer, 1) == pytest.approx(16 * 0.4)
    assert window_halves(repeats([100.0] * 6, [100.0] * 6), 1) is None  # under 4 steps a half


def test_a_new_records_plan_looks_as_often_as_stops_it_soonest() -> None:
    # a mean of 0.989 and a spread of 0.0085 (unsloth-zoo's on an H200, its window doubled): looking
    # every 16 repeats stops at 16, every 8 at 8
    assert repeat_ratios.new_record(0.989, 0.0085, 16, 2) == (16, 16)
    assert repeat_ratios.new_record(0.989, 0.0085, 8, 2) == (8, 8)
    assert repeat_ratios.cheapest_record(0.989, 0.0085, 16, 2) == (8, 8, 8)
    # where looking more often stops no sooner, the fewer looks (each at a wider level)
    assert repeat_ratios.new_record(0.989, 0.012, 8, 2)[1] == repeat_ratios.new_record(0.989, 0.012, 16, 2)[1] == 16
    assert repeat_ratios.cheapest_record(0.989, 0.012, 16, 2) == (16, 16, 16)
    # three sides a rotation: every plan looks after whole rotations, at least 4 repeats apart
    assert all(repeat_ratios.cheapest_record(0.99, 0.01, first, 3)[0] in (6, 9, 12) for first in (3, 6, 12))
    r = Ratios((0.995, 0.965, 0.99, 0.975, 1.002, 0.988), repeat_ratios.look_level(1))
    sd = statistics.stdev(r.values)
    every, most, stop = repeat_ratios.cheapest_record(r.mean, sd, 6, 2)  # from the record's first look
    assert repeat_ratios.what_it_takes(r, [6], 2, 60.0).startswith(
        f"past this record's 6, a new record with --repeats {every} --max-repeats {most} --look-every {every}: about "
        f"{stop} repeats")
