"""Baselines and gates on result documents (pure logic), and the gate / baseline commands."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from harness import schema
from harness.judge.baselines import BaselineError, Tolerances, build_baseline, pick_baseline, relative_spread
from harness.judge.gates import check_platform, gate
from harness.present.baseline_cli import baseline_filename
from tests.conftest import REPO, cli

MB = 1024 * 1024
ENV = {"os_name": "Linux", "cpu": "Test CPU", "device": "Device(cpu, 0)", "mlx_version": "0.32.4",
       "git_revision": "abc1234"}
LOSSES = [5.0, 4.0, 3.5, 3.25]


def _repeat(tok_s: float, losses: list[float] = LOSSES, mlx: tuple[int, ...] = (10 * MB,),
            rss: tuple[int, ...] = (100 * MB,)) -> dict[str, Any]:
    return {"ok": True, "median_tok_s": tok_s, "runtime_s": 1.0, "losses": list(losses),
            "mlx_peak_bytes": list(mlx), "rss_peak_bytes": list(rss), "avg_loss": sum(losses) / len(losses),
            "final_loss": losses[-1]}


def _doc(repeats: list[dict[str, Any]], env: dict[str, Any] = ENV, world_size: int = 1) -> dict[str, Any]:
    run = {"name": "single" if world_size == 1 else f"ddp{world_size}", "world_size": world_size,
           **repeats[0], "repeats": repeats}
    return schema.stamp({"passed": True, "exit_code": 0, "environment": env, "scenarios": [
        {"name": "s", "kind": "parity", "model": "qwen3 0.10M / 160", "runs": [run]}]})


def _baseline(spread_tok_s: tuple[float, ...] = (1000.0, 1000.0, 1000.0), **tol: float) -> dict[str, Any]:
    return build_baseline([(Path("b.json"), _doc([_repeat(t) for t in spread_tok_s]))], Tolerances(**tol))


def _gates(baseline: dict[str, Any], *repeats: dict[str, Any]) -> dict[str, Any]:
    gates, _, _ = gate(baseline, [(Path("r.json"), _doc(list(repeats)))], Tolerances(**baseline["tolerances"]))
    return {g.metric: g for g in gates}


def test_baseline_holds_medians_spread_and_golden_losses() -> None:
    b = _baseline((900.0, 1000.0, 1100.0))
    e = b["scenarios"]["s"]["single"]
    assert e["median_tok_s"] == 1000.0 and e["repeats"] == 3 and e["tok_s_spread"] == pytest.approx(0.1)
    assert e["losses"] == LOSSES and e["loss_spread"] == 0 and e["rss_peak_bytes"] == [100 * MB]
    assert b["platform"] == {k: ENV[k] for k in ("os_name", "cpu", "device", "mlx_version")}
    assert relative_spread([5.0]) == 0.0


def test_a_run_that_beats_the_baseline_passes() -> None:
    gates = _gates(_baseline(), _repeat(1200.0, mlx=(int(9.5 * MB),)), _repeat(1150.0))
    assert all(g.passed for g in gates.values()), [g.message() for g in gates.values()]
    assert gates["throughput"].current == "1175.0 tok/s (median of 2 repeats)"


def test_throughput_fails_only_beyond_the_larger_of_percent_and_spread() -> None:
    quiet = _baseline(throughput_pct=10.0)
    assert _gates(quiet, _repeat(920.0))["throughput"].passed  # -8%
    slow = _gates(quiet, _repeat(850.0))["throughput"]
    assert not slow.passed
    assert slow.message() == ("FAIL s/single throughput: 850.0 tok/s vs baseline 1000.0 tok/s (threshold -10.0% = "
                              "max(10% configured, 3 x 0.0% repeat spread over 3 repeats)); -15.0%; the baseline "
                              "came from a version that did not keep each repeat's fastest-steps speed as this one "
                              "weighs it: remake it (baseline update) for a band from its repeats")
    noisy = _baseline((900.0, 1000.0, 1100.0))  # 10% spread: 3 x 10% = 30% allowed
    assert _gates(noisy, _repeat(750.0))["throughput"].passed
    failed = _gates(noisy, _repeat(650.0))["throughput"]
    assert not failed.passed and "-30.0% = max(10% configured, 3 x 10.0% repeat spread" in failed.threshold


def _fast(*speeds: float, precision: str = "float32") -> list[dict[str, Any]]:
    return [{**_repeat(v), "fastest_tok_s": v, "precision": precision} for v in speeds]


def _fast_baseline(*speeds: float) -> dict[str, Any]:
    return build_baseline([(Path("b.json"), _doc(_fast(*speeds)))], Tolerances())


def test_the_fastest_steps_speed_weighs_each_step_by_its_padded_width() -> None:
    from harness.judge.baselines import fastest_tok_s

    # 21 padded steps of one width, every one 10 ms but the disturbed ones: the tokens a step
    # carries do not make it fast, so the speed is the mean tokens over the fastest steps' time
    tokens = [500] + [400, 800] * 10
    times = [0.05] + [0.010] * 18 + [0.020, 0.030]
    run = {"tok_s_global": [n / t for n, t in zip(tokens, times, strict=True)], "tokens_global_per_step": tokens,
           "input_widths": [128] * 21, "median_tok_s": 1.0}
    assert fastest_tok_s(run) == pytest.approx(600 / 0.010)
    # a step twice as wide does twice the work: its time counts per unit of width
    run["input_widths"] = [128] + [128, 256] * 10
    run["tok_s_global"] = [n / t for n, t in zip(tokens, [0.05] + [0.010, 0.020] * 10, strict=True)]
    assert fastest_tok_s(run) == pytest.approx(sum(tokens[1:]) / sum(run["input_widths"][1:]) * 128 / 0.010)
    # without widths each step's tokens are its work: the fastest two (45k and 42.1k tok/s) give
    # their tokens over their time, not the mean of their tok/s; without tokens, that mean
    del run["input_widths"]
    tokens = [500] + [400, 900] * 10
    times = [0.05, 0.0095, 0.020] + [0.012, 0.025] * 9
    run.update(tokens_global_per_step=tokens, tok_s_global=[n / t for n, t in zip(tokens, times, strict=True)])
    assert fastest_tok_s(run) == pytest.approx(1300 / 0.0295)
    del run["tokens_global_per_step"]
    assert fastest_tok_s(run) == pytest.approx((900 / 0.020 + 400 / 0.0095) / 2)
    assert fastest_tok_s({"tok_s_global": [], "median_tok_s": 7.0}) == 7.0


def test_a_baseline_made_before_the_weighed_speeds_is_gated_by_its_median_band() -> None:
    base = _fast_baseline(1000.0, 1050.0, 950.0)
    entry = base["scenarios"]["s"]["single"]
    entry["fast_tok_s_repeats"] = entry.pop("fastest_tok_s_repeats")  # as kept before 2026-12
    gates, _, _ = gate(base, [(Path("r.json"), _doc(_fast(990.0, 1010.0, 1000.0)))], Tolerances())
    speed = next(g for g in gates if g.metric == "throughput")
    assert "the baseline came from" in speed.detail and "remake it" in speed.detail
    assert "configured" in speed.threshold


def test_results_made_before_the_weighed_speeds_are_told_to_rerun_not_to_remake_the_baseline() -> None:
    base = _fast_baseline(1000.0, 1050.0, 950.0)
    old = [{k: v for k, v in r.items() if k != "fastest_tok_s"} for r in _fast(990.0, 1010.0, 1000.0)]
    gates, _, _ = gate(base, [(Path("r.json"), _doc(old))], Tolerances())
    speed = next(g for g in gates if g.metric == "throughput")
    assert "these results came from" in speed.detail and "rerun them" in speed.detail
    assert "remake" not in speed.detail and "configured" in speed.threshold


def test_a_baseline_with_its_repeats_speeds_is_tested_against_their_own_spread() -> None:
    """Baseline 1000/1050/950 (log spread 5.0 %), current repeats 850/800/820: the pooled t test
    (4 degrees of freedom) rejects "not slower"; 990/1010/1000 it does not."""
    base = _fast_baseline(1000.0, 1050.0, 950.0)
    assert base["scenarios"]["s"]["single"]["fastest_tok_s_repeats"] == [1000.0, 1050.0, 950.0]
    gates, _, _ = gate(base, [(Path("r.json"), _doc(_fast(850.0, 800.0, 820.0)))], Tolerances())
    slow = next(g for g in gates if g.metric == "throughput")
    assert not slow.passed and slow.detail.startswith("-17.6%, p = 0.0023")
    assert "t test against 3 baseline repeats of spread 5.0%" in slow.threshold
    assert "could have detected a 1" in slow.detail  # about 11 %: the smallest slowdown these repeats catch
    gates, _, _ = gate(base, [(Path("r.json"), _doc(_fast(990.0, 1010.0, 1000.0)))], Tolerances())
    assert next(g for g in gates if g.metric == "throughput").passed
    noisy = _fast_baseline(700.0, 1000.0, 1300.0)  # a baseline this noisy cannot catch 17.6 %, and says so
    gates, _, _ = gate(noisy, [(Path("r.json"), _doc(_fast(850.0, 800.0, 820.0)))], Tolerances())
    quiet = next(g for g in gates if g.metric == "throughput")
    assert quiet.passed and float(quiet.detail.split("could have detected a ")[1].split("%")[0]) > 30


def test_the_baseline_table_says_what_one_run_against_it_could_detect() -> None:
    """3 repeats of log spread 5 %, one run gated: t(0.95, 2) + t(0.90, 2) = 2.920 + 1.886 standard
    errors of 5 % x sqrt(1/3 + 1), a 24.2 % slowdown; a baseline without its speeds says its old band."""
    from harness.present.gate_report import baseline_rows

    (row,) = baseline_rows(_fast_baseline(1000.0, 1050.0, 950.0))
    assert row[6] == "24.2%"
    (old,) = baseline_rows(_baseline())
    assert old[6] == "-10.0% allowed (old band)"


def test_an_undecided_paired_gate_makes_the_gate_inconclusive_never_passed_or_failed() -> None:
    """A paired speed gate out of pairs, the other gates passing: INCONCLUSIVE and exit 4, in the
    text, the record and the regression table; a failing gate still makes it FAILED (exit 1)."""
    from harness.exit_codes import EXIT_CHECK_FAILED, EXIT_INCONCLUSIVE, EXIT_PASS
    from harness.present.gate_report import PairedGate, exit_code, gate_record, gate_text, verdict

    base = _fast_baseline(1000.0, 1050.0, 950.0)
    docs = [(Path("r.json"), _doc([{**r, "median_tok_s": r["fastest_tok_s"] - 100} for r in _fast(990.0, 1010.0)]))]
    gates, notes, compared = gate(base, docs, Tolerances())
    others = [g for g in gates if g.metric != "throughput"]
    assert others and all(g.passed for g in others)
    undecided = PairedGate("s", "single", "throughput (paired)", False, "990.0 fastest-tenth tok/s",
                           "1000.0 fastest-tenth tok/s", "at most 0% slower, p >= 0.01",
                           "1.0% slower (interval -50.0% to +96.0%); inconclusive: not decided by 4 pairs",
                           inconclusive=True)
    assert undecided.result == "INCONCLUSIVE" and not undecided.passed
    assert verdict([*others, undecided]) == "INCONCLUSIVE" and exit_code([*others, undecided]) == EXIT_INCONCLUSIVE
    assert EXIT_INCONCLUSIVE == 4
    decided = dataclasses.replace(undecided, passed=True, inconclusive=False)
    assert verdict([*others, decided]) == "PASSED" and exit_code([*others, decided]) == EXIT_PASS
    alarm = PairedGate("s", "single", "throughput (paired)", False, "800.0", "1000.0", "at most 0% slower", "")
    assert alarm.result == "FAIL" and exit_code([*others, alarm]) == EXIT_CHECK_FAILED
    assert verdict([*others, undecided, alarm]) == "FAILED"  # a failure is a failure, decided or not

    from harness.present.gate_report import add_fast_speeds

    add_fast_speeds(compared, docs)
    text = gate_text([*others, undecided], notes, compared, base, ENV, "HEAD (abc1234)",
                     sides=(("HEAD", "abc1234"), ("this checkout", "def5678+dirty")))
    head = text.splitlines()[0]
    assert head == f"gate against HEAD (abc1234): INCONCLUSIVE ({len(others)} of {len(others) + 1} gates passed, " \
                   "1 inconclusive)"
    assert "PASSED" not in text and "FAILED" not in text and "rerun with a larger --pairs" in text
    assert "flaky check" not in text  # the advice fits what could not decide
    flaky = PairedGate("s", "single", "checks", False, "1 of 3 fail", "3 pass", "every check that passes",
                       "loss_parity: 0.2 against limit 0.1 (1 of 2 runs)", inconclusive=True, flaky=("loss_parity",))
    flaky_text = gate_text([*others, flaky], notes, compared, base, ENV, "HEAD (abc1234)")
    assert "flaky check" in flaky_text and "--pairs" not in flaky_text
    assert "INCONCLUSIVE s/single throughput (paired): 990.0 fastest-tenth tok/s vs baseline" in text
    lines = text.splitlines()
    header = next(ln for ln in lines if ln.startswith("Model / seq"))
    assert "  Run  " in header and "Revision" in header and "Branch" not in header
    assert "Post-step-1 median tok/s" in header and "Gated speed: fastest-tenth tok/s" in header
    rows = [re.split(r"\s{2,}", ln) for ln in lines if ln.startswith("qwen3 0.10M / 160")]
    # the run; the repository's revision on each side, and the harness's (abc1234 in ENV) where it
    # differs; both speeds: the post-step-1 median and the gated one (the median over the repeats)
    assert [r[1:5] for r in rows] == [["s", "single", "Test CPU", "HEAD (abc1234)"],
                                      ["s", "single", "Test CPU", "this checkout (def5678+dirty; harness abc1234)"]]
    assert [r[6:8] for r in rows] == [["1000.0", "1000.0"], ["900.0", "1000.0"]]
    record = gate_record([*others, undecided], notes, "HEAD (abc1234)", ENV)
    assert record["verdict"] == "inconclusive" and record["exit_code"] == 4 and record["passed"] is False
    assert {tuple(sorted(g)) for g in record["gates"]} == {tuple(sorted(record["gates"][0]))}  # the same fields
    assert record["gates"][-1]["result"] == "INCONCLUSIVE"


def test_another_precision_is_refused_unless_forced() -> None:
    base = _fast_baseline(1000.0, 1050.0, 950.0)
    docs = [(Path("r.json"), _doc(_fast(1000.0, precision="bfloat16")))]
    with pytest.raises(BaselineError, match="s/single ran at precision bfloat16, its baseline at float32: refusing"):
        gate(base, docs, Tolerances())
    _, notes, _ = gate(base, docs, Tolerances(), force=True)
    assert "s/single: compared across precisions (forced): bfloat16 vs baseline float32" in notes


def test_a_different_loss_fails_naming_the_step_values_and_tolerance() -> None:
    b = _baseline()
    assert _gates(b, _repeat(1000.0, [5.0, 4.0, 3.500004, 3.25]))["loss"].passed  # within 1e-5
    bad = _gates(b, _repeat(1000.0, [5.0, 4.0, 3.6, 3.25]))["loss"]
    assert not bad.passed
    assert bad.message() == ("FAIL s/single loss: 3.600000 at step 3 vs baseline 3.500000 (threshold 1e-05 = "
                             "max(1e-05 configured, 3 x 0 repeat spread)); max |delta| 0.1 over 4 steps")
    short = _gates(b, _repeat(1000.0, LOSSES[:3]))["loss"]
    assert not short.passed and short.current == "3 steps" and short.baseline == "4 steps"


def test_memory_fails_in_both_directions() -> None:
    b = _baseline(memory_pct=10.0)
    bigger = _gates(b, _repeat(1000.0, rss=(125 * MB,)))["peak RSS"]
    assert not bigger.passed
    assert bigger.message() == ("FAIL s/single peak RSS: 125.0 MB on rank 0 vs baseline 100.0 MB (threshold ±10%); "
                                "+25.0%; per rank 125.0")
    smaller = _gates(b, _repeat(1000.0, mlx=(8 * MB,)))["peak MLX memory"]
    assert not smaller.passed and "-20.0%" in smaller.detail
    assert _gates(b, _repeat(1000.0, rss=(105 * MB,)))["peak RSS"].passed


def test_a_failed_run_fails_its_gate() -> None:
    gates = _gates(_baseline(), dict(_repeat(1000.0), ok=False))
    assert list(gates) == ["run"] and not gates["run"].passed


def test_another_platform_is_refused_unless_forced() -> None:
    b = _baseline()
    other = _doc([_repeat(1000.0)], env=dict(ENV, cpu="Apple M3 Max", mlx_version="0.33.0"))
    with pytest.raises(BaselineError, match=r"r.json was measured on another platform than baseline b.json "
                                            r"\(differs in cpu, mlx_version: .*refusing to compare \(--force"):
        check_platform(b, Path("b.json"), other, Path("r.json"), force=False)
    notes = check_platform(b, Path("b.json"), other, Path("r.json"), force=True)
    assert notes[0] == "compared across platforms (forced): cpu 'Apple M3 Max' vs baseline 'Test CPU'"


def test_a_baseline_needs_repeats_one_platform_and_passing_runs() -> None:
    with pytest.raises(BaselineError, match=r"s/single: 1 repeat\(s\); measuring the repeat spread needs at least 2"):
        build_baseline([(Path("a.json"), _doc([_repeat(1000.0)]))], Tolerances())
    two = [(Path("a.json"), _doc([_repeat(1000.0)])),
           (Path("b.json"), _doc([_repeat(1000.0)], env=dict(ENV, device="Device(gpu, 0)")))]
    with pytest.raises(BaselineError, match="b.json: measured on another platform than a.json .differs in device"):
        build_baseline(two, Tolerances())
    pooled = build_baseline([(Path("a.json"), _doc([_repeat(1000.0)])), (Path("b.json"), _doc([_repeat(900.0)]))],
                            Tolerances())
    assert pooled["scenarios"]["s"]["single"]["repeats"] == 2  # repeats pooled across results
    with pytest.raises(BaselineError, match="1 repeat.s. failed"):
        build_baseline([(Path("a.json"), _doc([_repeat(1.0), _repeat(1.0), dict(_repeat(1.0), ok=False)]))],
                       Tolerances())


def _write(path: Path, doc: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def test_gate_and_baseline_commands(tmp_path: Path) -> None:
    runs = _write(tmp_path / "runs" / "result.json", _doc([_repeat(1000.0), _repeat(1040.0), _repeat(980.0)]))
    bases = tmp_path / "baselines"
    bases.mkdir()
    made = cli("baseline", "update", "--baseline", str(bases), str(runs.parent), "--throughput-pct", "5")
    assert made.returncode == 0, made.stderr
    written = bases / baseline_filename(ENV)
    assert written.name == "linux-test-cpu-cpu-mlx0.32.4.json" and f"wrote {written}" in made.stdout
    assert json.loads(written.read_text())["tolerances"]["throughput_pct"] == 5.0

    other = _doc([_repeat(500.0), _repeat(510.0)], env=dict(ENV, git_revision="def5678"))
    other["scenarios"][0]["name"] = "t"
    more = cli("baseline", "update", "--baseline", str(bases), str(_write(tmp_path / "t" / "result.json", other)))
    assert more.returncode == 0, more.stderr  # a new scenario joins; "s", not in these results, is kept
    merged = json.loads(written.read_text())
    assert set(merged["scenarios"]) == {"s", "t"} and merged["scenarios"]["s"]["single"]["median_tok_s"] == 1000.0
    assert merged["tolerances"]["throughput_pct"] == 5.0
    # each run keeps the revision it was measured at; the file's is the latest update's
    assert merged["git_revision"] == merged["scenarios"]["t"]["single"]["git_revision"] == "def5678"
    assert merged["scenarios"]["s"]["single"]["git_revision"] == "abc1234"
    t_run = _write(tmp_path / "t_run.json", _doc([_repeat(505.0)], env=dict(ENV, git_revision="0ff1ce0")))
    t_run_doc = json.loads(t_run.read_text())
    t_run_doc["scenarios"][0]["name"] = "t"
    t_run.write_text(json.dumps(t_run_doc))
    rows = cli("gate", "--baseline", str(bases), str(runs), str(t_run))
    assert rows.returncode == 0, rows.stdout + rows.stderr
    assert "baseline (harness abc1234)" in rows.stdout and "baseline (harness def5678)" in rows.stdout, rows.stdout

    ok = cli("gate", "--baseline", str(bases), str(runs))  # a directory: the platform's file is picked
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASSED (4 of 4 gates passed)" in ok.stdout and "Single-process regression against the baseline" in ok.stdout
    slower = _write(tmp_path / "slow.json", _doc([_repeat(700.0)]))
    failed = cli("gate", "--baseline", str(written), str(slower), "--out", str(tmp_path / "gate"))
    assert failed.returncode == 1
    assert "FAIL s/single throughput: 700.0 tok/s vs baseline 1000.0 tok/s (threshold -" in failed.stdout
    record = json.loads((tmp_path / "gate" / "gate.json").read_text())  # why it failed, for a CI job to read
    assert record["kind"] == "gate" and record["passed"] is False and record["against"] == str(written)
    by_metric = {g["metric"]: g for g in record["gates"]}
    assert set(by_metric) == {"throughput", "loss", "peak MLX memory", "peak RSS"}
    assert by_metric["throughput"]["result"] == "FAIL" and by_metric["loss"]["result"] == "pass"
    assert all(set(g) == {"scenario", "run", "metric", "passed", "current", "baseline", "threshold", "detail",
                          "result"} for g in record["gates"])
    summary = tmp_path / "summary.md"
    cli_env = cli("gate", "--baseline", str(written), str(slower), "--throughput-pct", "40",
                  env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert cli_env.returncode == 0, cli_env.stdout
    assert summary.read_text().startswith("gate against") and "| throughput " in summary.read_text()

    mac = _write(tmp_path / "mac.json", _doc([_repeat(1000.0)], env=dict(ENV, cpu="Apple M3 Max")))
    refused = cli("gate", "--baseline", str(written), str(mac))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "--force" in refused.stderr
    assert cli("gate", "--baseline", str(written), str(mac), "--force").returncode == 0
    none = cli("gate", "--baseline", str(bases), str(mac))
    assert none.returncode == 2 and "no baseline for this platform" in none.stderr

    before = written.read_bytes()
    one = _write(tmp_path / "one.json", _doc([_repeat(1000.0)]))
    bad = cli("baseline", "update", "--baseline", str(written), str(one))
    assert bad.returncode == 2 and "needs at least 2" in bad.stderr and written.read_bytes() == before
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    for args in (("gate", "--baseline", str(corrupt), str(runs)),
                 ("baseline", "update", "--baseline", str(corrupt), str(runs))):
        proc = cli(*args)
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: {corrupt}") and proc.stderr.count("\n") == 1
    assert corrupt.read_text() == "{not json"


def test_the_committed_baseline_covers_the_full_suite() -> None:
    from harness.present.cli import resolve_scenarios

    files = sorted((REPO / "reports" / "baselines").glob("*.json"))
    assert files, "reports/baselines holds no baseline"
    for f in files:
        _, b = pick_baseline(f, {})
        assert b["platform"]["os_name"] == "Linux" and f.name == baseline_filename(b["platform"])
        want = {(s.name, r.name) for s in resolve_scenarios([], every=True) for r in s.runs if r.expect_error is None}
        have = {(s, r) for s, runs in b["scenarios"].items() for r in runs}
        assert have == want
        for entry in (r for runs in b["scenarios"].values() for r in runs.values()):
            assert entry["repeats"] >= 3 and entry["median_tok_s"] > 0 and len(entry["rss_peak_bytes"]) == \
                entry["world_size"]


def test_gating_leaves_the_baseline_unchanged() -> None:
    b = _baseline()
    kept = copy.deepcopy(b)
    _gates(b, _repeat(10.0))
    assert b == kept


@pytest.mark.ranks
def test_repeat_baseline_and_gate_on_real_runs(tmp_path: Path) -> None:
    from tests.conftest import write_scenario

    scenario = write_scenario(tmp_path, "gated", (1, 2), steps=4)
    out = tmp_path / "out"
    proc = cli("run", str(scenario), "--repeat", "2", "--out", str(out), "--plots")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "Spread (stdev / median)" in proc.stdout and "repeat 2 of 2" in proc.stderr
    (s,) = json.loads((out / "result.json").read_text())["scenarios"]
    for run in s["runs"]:
        assert len(run["repeats"]) == 2 and run["repeats"][0]["losses"] == run["repeats"][1]["losses"]
    assert (out / "runs" / "gated" / "ddp2").is_dir() and (out / "runs-repeat2" / "gated" / "ddp2").is_dir()
    assert sorted(p.name for p in (out / "plots").iterdir()) == ["gated-delta.png", "gated-loss.png",
                                                                 "gated-memory.png", "gated-throughput.png"]
    baseline = tmp_path / "base.json"
    made = cli("baseline", "update", "--baseline", str(baseline), str(out))
    assert made.returncode == 0, made.stderr
    passed = cli("gate", "--baseline", str(baseline), str(out))  # its own repeats: the same medians
    assert passed.returncode == 0 and "PASSED (8 of 8 gates passed)" in passed.stdout, passed.stdout
