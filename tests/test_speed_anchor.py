"""The speed anchor (mlx-lm's own step in a plain loop) and the side-by-side benchmark (the reference
trainer, mlx-lm's trainer and that step), with real ranks under mlx.launch."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from harness.controller.run_job import execute
from harness.scenario import load_scenario
from harness.scenario.job import AnchorJob
from harness.scenario.plan import job_for
from tests.conftest import REPO

pytestmark = pytest.mark.ranks


@pytest.mark.full  # a benchmark's own parts (benchmarks/step_vs_mlx_lm.py)
def test_the_anchor_trains_mlx_lm_steps_on_every_rank(tmp_path) -> None:  # noqa: ANN001
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from step_vs_mlx_lm import scenario_text
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    path = tmp_path / "s.toml"
    path.write_text(scenario_text("tiny", [2], 4))
    s = load_scenario(path)
    spec = s.run("ws2_compiled")
    out = execute(spec.name, AnchorJob(s.for_run(spec)), 2)
    assert out.ok, out.failure
    for o in out.ranks:
        r = o.result
        assert r["tokens_global_per_step"] == [16 * 160] * 4 and r["compile"] is True  # 2 ranks x 8 rows x 160 targets
        assert r["input_widths"] == [160] * 4 and r["mlx_compile"] is True  # rows of max_seq_len = 161 tokens
        assert len(r["tok_s_global"]) == 4 and all(v > 0 for v in r["tok_s_global"])
    losses = [[e["loss"] for e in o.events if e.get("kind") == "step"] for o in out.ranks]
    assert losses[0] != losses[1] and all(math.isfinite(x) for row in losses for x in row)  # each rank its own rows
    # It trains the rows the reference trains: the reference starts from the same weights on the same
    # global batch, so its step-1 loss is the mean of the two ranks' (every row has 160 targets).
    ref = execute("ws2_eager", job_for(s, "ws2_eager"), 2, backend=s.run("ws2_eager").backend)
    assert ref.ok, ref.failure
    first = ref.result(0)["losses"][0]
    assert abs(first - (losses[0][0] + losses[1][0]) / 2) <= 1e-5 * first, (first, losses[0][0], losses[1][0])


@pytest.mark.full  # a benchmark, run small
def test_the_side_by_side_benchmark_prints_the_three() -> None:
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_vs_mlx_lm.py"), "--model", "tiny", "--steps",
                        "3", "--world-sizes", "1,2", "--repeats", "1"], capture_output=True, text=True, cwd=REPO,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[0].startswith("tiny: qwen3 0.09M, float32, 8 x 160 inputs per rank, 3 steps, the best of each run")
    rows = [line.split() for line in lines[3:7]]
    assert [(r[0], r[1]) for r in rows] == [("1", "eager"), ("1", "compiled"), ("2", "eager"), ("2", "compiled")]
    for r in rows:  # tok/s of the harness, mlx-lm's trainer and its step; harness / trainer; scaling; MFU; widths
        assert all(float(v) > 0 for v in r[2:5]) and abs(float(r[5][:-1]) - float(r[2]) / float(r[3])) <= 0.01
        assert len(r[6].split("/")) == 3 and r[7:9] == ["-", "-"]
        assert r[9:] == ["160", "160", "160"]  # every trainer trained the rows' 160 inputs, none padded wider
    assert "MLX_DISABLE_COMPILE=1" in lines[7]  # the eager rows ran with compile off (the step loop's rank checked)
    # where each step's time went: the harness's and the step loop's fetch, build, eval and step medians (ms)
    at = next(i for i, line in enumerate(lines) if "Fetch ms" in line)
    phases = [line.split() for line in lines[at + 2 : at + 10]]
    assert [tuple(r[:3]) for r in phases] == [(n, m, who) for n in ("1", "2") for m in ("eager", "compiled")
                                              for who in ("harness", "step")]
    for r in phases:
        fetch, build, evaluate, step = map(float, r[3:7])
        assert build > 0 and evaluate > 0 and step >= max(fetch, build, evaluate)  # each step holds its parts
        assert (fetch == 0) == (r[2] == "step")  # the loop fetches nothing: its batches are made before its steps
    # the all-reduce alone beside the 2-rank step: world size, MiB, all-reduce ms, step ms at 1 and 2, extra, share
    at = next(i for i, line in enumerate(lines) if "all-reduce ms (alone)" in line)
    (reduce,) = [line.split() for line in lines[at + 2 :]]
    assert reduce[:2] == ["2", "eager"]  # beside the eager step, where it ran
    reduce = reduce[1:]
    assert reduce[0] == "eager" and float(reduce[1]) > 0 and float(reduce[2]) > 0 and float(reduce[4]) > 0
    assert abs(float(reduce[5]) - (float(reduce[4]) - float(reduce[3]))) <= 0.02
    assert abs(float(reduce[6][:-1]) - 100 * float(reduce[2]) / float(reduce[4])) <= 0.1


def test_a_figure_over_repeats_names_the_repeat_kept_and_the_range() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from step_vs_mlx_lm import figure, kept, ratio_figure
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    assert kept([75076.0, 77000.0, 79281.0]) == 2 and figure([75076.0, 77000.0, 79281.0]) == "79281 (r3/3: 75076-79281)"
    assert figure([63002.0]) == "63002"  # one repeat: the figure alone
    # scaling: the kept figures' ratio, then the range of repeat r over repeat r (measured next to each other)
    assert ratio_figure([160.0, 200.0], [100.0, 90.0]) == "2.00x (1.60-2.22x)"
    assert ratio_figure([180.0], [100.0]) == "1.80x"


@pytest.mark.ranks  # a benchmark, run small: the reference against the bare step alone, recorded, then reported
def test_the_benchmark_without_the_trainer_runs_two_and_reports_its_record(tmp_path: Path) -> None:
    record = tmp_path / "step.jsonl"

    def bench(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_vs_mlx_lm.py"), "--model", "tiny",
                               "--steps", "3", "--world-sizes", "1", "--modes", "eager", "--repeats", "1",
                               "--without-trainer", "--record", str(record), *extra], capture_output=True, text=True,
                              cwd=REPO, timeout=600)

    p = bench()
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (got,) = [json.loads(line)["data"]["got"] for line in record.read_text().splitlines()[1:]]
    assert got[1] is None and got[0][0] > 0 and got[2][0] > 0  # the reference and the bare step ran, no trainer
    row = next(line.split() for line in p.stdout.splitlines() if line.split()[:2] == ["1", "eager"])
    assert float(row[2]) > 0 and row[3] == "-" and float(row[4]) > 0 and row[5] == "-"  # the trainer's tok/s, ratio
    assert row[6] == "1.00x/-/1.00x" and row[9:] == ["160", "-", "160"]  # its scaling and width left out too
    before = record.read_bytes()
    again = bench("--report-only")
    assert again.returncode == 0 and again.stdout == p.stdout, again.stderr  # the same report from the record alone
    assert record.read_bytes() == before


@pytest.mark.full  # a benchmark, run small: the reference and the bare step at once, taking turns
def test_the_reference_and_the_bare_step_take_turns_and_time_only_their_own_steps(tmp_path: Path) -> None:
    record = tmp_path / "turns.jsonl"
    steps, first, k = 12, 4, 2
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_vs_mlx_lm.py"), "--model", "tiny", "--steps",
                        str(steps), "--world-sizes", "1", "--modes", "compiled", "--repeats", "2", "--without-trainer",
                        "--turns", str(k), "--from", str(first), "--record", str(record)], capture_output=True,
                       text=True, cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    head, *repeats = (json.loads(line) for line in record.read_text().splitlines())
    assert head["plan"]["--turns"] == k and head["plan"]["--from"] == first and len(repeats) == 2
    for r in repeats:
        got, waited = r["data"]["got"], r["data"]["waited_s"]
        assert got[1] is None and set(waited) == {"harness", "step"}
        for (figure, result), side in ((got[0], "harness"), (got[2], "step")):
            times = result["step_times_s"]
            assert len(times) == steps and figure > 0
            # each waited through the other's turns, and none of that wait is in a step's time
            assert waited[side] > 0.5 * sum(times[first:]), (side, waited, times)
            assert max(times[first:]) < 2 * sorted(times[first:])[len(times[first:]) // 2], times  # a wait: 3x
        timeline = r["data"]["timeline"]  # the turns began once both had started; each ended after them
        assert set(timeline["ended_s"]) == {"harness", "step"} and 0 < timeline["turns_s"]
        assert min(timeline["ended_s"].values()) > timeline["turns_s"]
    assert "median after step 4 of the best repeat" in p.stdout
    assert "1 compiled, taking turns: a repeat's timeline (medians of 2, s from launch): the last side ended at " \
        in p.stdout


def test_the_anchor_hides_torch_as_the_trainers_beside_it_do() -> None:
    """Importing mlx-lm brings in transformers, and with it torch where installed (some 10 s of a
    rank's start on a GPU machine that has it): the anchor's rank marks it absent first, as the
    reference trainer and mlx-lm's adapter do (``TrainerInfo.hides``)."""
    code = ("import sys\n"
            "from harness.rank.entry import load_libraries\n"
            "from harness.scenario import load_scenario\n"
            "from harness.scenario.job import AnchorJob\n"
            "load_libraries(AnchorJob(load_scenario(sys.argv[1])))\n"
            "print([sys.modules.get(name, 'absent') is None for name in ('torch', 'torchvision')])\n")
    p = subprocess.run([sys.executable, "-c", code, str(REPO / "scenarios" / "text_parity.toml")], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[True, True]", p.stdout + p.stderr[-2000:]
