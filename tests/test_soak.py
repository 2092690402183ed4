"""``mlx-ddp-harness soak``: the exact interval of a hang rate, the soak job's file, and real
ranks under mlx.launch: a clean soak makes exactly its calls without a hang, a planted hang is
counted once, named from the ledgers and relaunched past, and a time limit ends a cell cleanly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.controller import rank_budget
from harness.judge.rates import Rate, binom_cdf, clopper_pearson, quantile
from harness.present.cli import main
from harness.rank.models import TINY
from harness.scenario import ModelSpec
from harness.scenario.job import JobError, SoakJob, SoakStop, job_from_json

REPO = Path(__file__).resolve().parents[1]
WATCHDOG_S = "3"  # the planted hang's no-progress limit: a hang costs this much of the test's time


def test_the_interval_is_exact_at_known_values() -> None:
    lo, hi = clopper_pearson(0, 10000)
    assert lo == 0 and hi * 1000 == pytest.approx(0.3688, abs=1e-4)
    lo, hi = clopper_pearson(3, 100)
    assert (lo, hi) == (pytest.approx(0.0062, abs=5e-5), pytest.approx(0.0852, abs=5e-5))
    lo, hi = clopper_pearson(5, 10)
    assert (lo, hi) == (pytest.approx(0.1871, abs=1e-4), pytest.approx(0.8129, abs=1e-4))
    assert clopper_pearson(10, 10) == (pytest.approx(0.025 ** 0.1), 1.0)
    # the ends are where the binomial tails hold alpha / 2 each
    lo, hi = clopper_pearson(7, 2000)
    assert binom_cdf(7, 2000, hi) == pytest.approx(0.025, abs=1e-9)
    assert 1 - binom_cdf(6, 2000, lo) == pytest.approx(0.025, abs=1e-9)


def test_a_rate_without_a_hang_still_gives_an_upper_bound() -> None:
    assert Rate(0, 10000).text() == "0 [0, 0.369]"
    assert Rate(3, 100).text() == "30 [6.23, 85.2]"
    assert Rate(0, 0).text() == "-"
    assert Rate(1, 4000).to_json()["rate"] == 0.25
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5 and quantile([], 0.5) is None


def test_the_soak_job_reads_back_strictly() -> None:
    jobs = [SoakJob(shapes=((1024,), (3, 4)), stream="default", calls=9, first_call=4, stop=SoakStop(1, 7)),
            SoakJob(config={"model_type": "llama", "hidden_size": 8}, seconds=12.5),
            SoakJob(model=ModelSpec(arch="qwen3"), vocab_size=259, calls=3).launched(world_size=2, backend="ring")]
    for job in jobs:
        assert job_from_json(json.loads(json.dumps(job.to_json()))) == job
    with pytest.raises(JobError, match="soak job: unknown key"):
        job_from_json({**jobs[0].to_json(), "rounds": 3})
    with pytest.raises(JobError, match="soak job's stop: unknown key"):
        job_from_json({**jobs[0].to_json(), "stop": {"rank": 1, "call": 2, "signal": 19}})


def _soak(tmp_path: Path, *options: str) -> tuple[int, dict]:
    code = main(["soak", "--ranks", "2", "--bytes", "4096", "--out", str(tmp_path), *options])
    return code, json.loads((tmp_path / "soak.json").read_text())


@pytest.mark.ranks
def test_a_clean_soak_makes_its_calls_without_a_hang(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = _soak(tmp_path, "--streams", "cpu,default", "--calls", "200", "--watchdog", "10")
    assert code == 0
    assert [(c["stream"], c["calls"], len(c["hangs"]), c["failures"], c["launches"]) for c in doc["cells"]] == \
        [("cpu", 200, 0, [], 1), ("default", 200, 0, [], 1)]
    for c in doc["cells"]:
        assert c["rate"]["rate"] == 0 and c["rate"]["high"] == pytest.approx(18.27, abs=0.01)  # 0 of 200
        assert c["call_ms"]["rounds"] == 200 and 0 < c["call_ms"]["median"] <= c["call_ms"]["p95"]
    assert not (tmp_path / "launches").exists()  # an ok launch keeps no files
    out = capsys.readouterr().out
    assert "Hangs / 1k calls [95% CI]" in out and out.count("0 [0, 18.3]") == 2


@pytest.mark.ranks
def test_a_planted_hang_is_counted_named_and_relaunched_past(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = _soak(tmp_path, "--streams", "cpu", "--calls", "200", "--watchdog", WATCHDOG_S,
                      "--plant-hang", "1:101")
    assert code == 1, doc["cells"]  # a hang was counted (else the failure says what the launch met)
    (cell,) = doc["cells"]
    assert (cell["calls"], cell["launches"], cell["failures"], cell["stopped"]) == (200, 2, [], None)
    (hang,) = cell["hangs"]
    assert (hang["kind"], hang["at_call"], hang["launch"], hang["planted"]) == ("hang", 101, 1, True)
    assert hang["detail"] == f"no progress from any rank for {WATCHDOG_S} s"
    ledgers = hang["collectives"]
    assert not ledgers["agree"] and ledgers["seq"] == 100  # rank 0 issued call 101 (seq 100) and waits in it
    assert {r: e and (e["op"], e["shape"], e["step"]) for r, e in ledgers["ranks"].items()} == \
        {"0": ("all_sum", [1024], 101), "1": None}
    assert hang["stopped_answering"] == [1] and hang["line"].startswith("rank 1 stopped answering; "), hang["line"]
    assert "#100: rank 0: all_sum float32[1024]" in hang["line"] and "rank 1: no collective (behind" in hang["line"]
    kept = Path(hang["files"])
    assert {f"rank{r}.collectives.jsonl" for r in range(2)} <= {p.name for p in kept.iterdir()}
    assert cell["rate"]["events"] == 1 and cell["rate"]["trials"] == 200
    out = capsys.readouterr().out
    assert "hang (planted by --plant-hang) at call 101 (launch 1): rank 1 stopped answering" in out


@pytest.mark.ranks
def test_a_hang_planted_inside_a_gradient_shaped_round_names_its_call_and_rank(tmp_path: Path) -> None:
    """A round of a model's gradient shapes: the planted call is named, not the round's first."""
    config = tmp_path / "model.json"
    config.write_text(json.dumps({**TINY["qwen3"], "vocab_size": 64}))
    code = main(["soak", "--ranks", "2", "--model", str(config), "--out", str(tmp_path), "--streams", "cpu",
                 "--calls", "60", "--watchdog", WATCHDOG_S, "--plant-hang", "1:37"])
    doc = json.loads((tmp_path / "soak.json").read_text())
    (cell,) = doc["cells"]
    assert code == 1 and cell["arrays"] > 20 and cell["calls"] == 60, cell  # 37 falls inside the second round
    (hang,) = cell["hangs"]
    assert (hang["at_call"], hang["stopped_answering"]) == (37, [1]), hang
    assert hang["line"].startswith("rank 1 stopped answering; collectives diverge at call #36: rank 0: all_sum")


@pytest.mark.ranks
def test_a_time_limit_ends_a_cell_on_an_agreed_round(tmp_path: Path) -> None:
    """Without --calls, the ranks agree when to stop (all_min of their estimates): the launch ends
    ok, every rank after the same call."""
    code, doc = _soak(tmp_path, "--streams", "default", "--ranks", "3", "--minutes", "0.05", "--watchdog", "10")
    (cell,) = doc["cells"]
    assert code == 0 and cell["launches"] == 1 and not cell["hangs"] and not cell["failures"], cell
    # the ranks call for about the cell's 3 s: not cut short, not run on to the wall limit (start-up and
    # waiting for rank slots beside other tests' launches are outside it, and vary with the machine's load)
    assert cell["calls"] > 1 and 2 < cell["calls_s"] < 3 + 3, cell
    assert doc["calls_per_cell"] is None and doc["seconds_per_cell"] == 3.0


HOLDER = """
import sys, time
from harness.controller import rank_budget
slots = rank_budget.hold(2, "run 'neighbour'")
print("held", flush=True)
time.sleep(float(sys.argv[1]))
"""


@pytest.mark.ranks
def test_time_queued_for_rank_slots_takes_nothing_from_a_timed_cell(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """A launch that waits for rank slots beside another launch still gets its cell's time for calls."""
    monkeypatch.setenv(rank_budget.DIR_VAR, str(tmp_path / "slots"))
    monkeypatch.setenv(rank_budget.BUDGET_VAR, "2")
    monkeypatch.delenv(rank_budget.HELD_VAR, raising=False)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "5"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code, doc = _soak(tmp_path / "out", "--streams", "cpu", "--minutes", "0.05", "--watchdog", "10")
    finally:
        holder.wait(timeout=30)
    (cell,) = doc["cells"]
    assert code == 0 and cell["queued_s"] > 3, cell  # it waited for the neighbour's 2 slots
    assert cell["calls"] > 10 and 2 < cell["calls_s"] < 3 + 3, cell


@pytest.mark.parametrize("options, says", [
    (["--backends", "ring,foo"], "--backends: unknown backend 'foo'"),
    (["--ranks", "1,2"], "--ranks: every rank count must be at least 2"),
    (["--calls", "0"], "--calls must be at least 1, got 0"),
    (["--model", "missing.json"], "--model missing.json: no such file"),
    (["--bytes", "6"], "--bytes must be a positive multiple of 4"),
    (["--streams", "gpu"], "--streams: unknown stream 'gpu'"),
    (["--plant-hang", "2:5"], "--plant-hang: expected RANK:CALL"),
])
def test_bad_input_is_one_line(options: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["soak", "--ranks", "2", *options] if "--ranks" not in options else ["soak", *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + says) and err.count("\n") == 1 and "Traceback" not in err, err
