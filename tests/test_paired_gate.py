"""``gate --against REV``: the paired speed test (pure logic) and the whole command against a
revision of this repository, with real runs on both sides."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import norm

from harness.exit_codes import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_INCONCLUSIVE, EXIT_INFRA, EXIT_PASS
from harness.judge.paired import SequentialDesign, pocock_level, sequential_look
from harness.present.paired_gates import PairMode, pair_mode
from tests.conftest import REPO, cli, write_scenario


def test_the_paired_test_uses_students_t_as_its_tables_give_it() -> None:
    """Five pairs whose log ratios have mean -0.1 and standard error 0.0316: the 95 % interval's
    half-width is t(0.975, 4) = 2.776 standard errors; "at most 5 % slower" has p = P(T4 < -1.54)
    and "10 % or more slower" p = P(T4 > 0.17)."""
    logs = [-0.1, -0.2, 0.0, -0.1, -0.1]
    design = SequentialDesign(margin=0.05, detect=0.10, alpha=0.05, min_pairs=5, max_pairs=5)
    v = sequential_look([1.0] * 5, [math.exp(x) for x in logs], design)
    se = math.sqrt(0.005 / 5)
    assert v.low == pytest.approx(math.exp(-0.1 - 2.776 * se) - 1, abs=2e-4)
    assert v.high == pytest.approx(math.exp(-0.1 + 2.776 * se) - 1, abs=2e-4)
    assert v.p_alarm == pytest.approx(0.0992, abs=2e-3)  # t(0.90, 4) = 1.533
    assert v.p_pass == pytest.approx(0.4375, abs=5e-3)
    assert design.alarm_level == 0.05 and not v.early  # one look, neither rejected
    assert v.decided == "inconclusive" and v.inconclusive and not v.alarm  # out of pairs: neither pass nor alarm
    assert "inconclusive: not decided by 5 pairs, the most allowed" in v.describe()


def test_pococks_level_is_the_one_crossed_at_some_look_with_the_stated_chance() -> None:
    assert pocock_level(0.05, (5,)) == 0.05
    level = pocock_level(0.05, (3, 4, 5, 6, 7, 8, 9, 10))
    assert 0.012 < level < 0.02  # Pocock's constant for 8 looks is about 2.2 (one-sided 0.05)
    z = [rng_path for rng_path in _brownian(np.random.default_rng(3), 20000, range(3, 11))]
    crossed = np.mean(np.any(np.array(z) > norm.isf(level), axis=1))
    assert crossed == pytest.approx(0.05, abs=0.006)


def _brownian(rng: np.random.Generator, paths: int, looks: range) -> list[list[float]]:
    steps = rng.standard_normal((paths, max(looks)))
    sums = np.cumsum(steps, axis=1)
    return [[float(row[n - 1] / math.sqrt(n)) for n in looks] for row in sums]


def _simulate(design: SequentialDesign, change: float, sigma: float, tries: int, seed: int
              ) -> tuple[dict[str, float], float]:
    """How often a run ``change`` slower alarms, passes and ends inconclusive, and its median pairs,
    with pair ratios of noise ``sigma``."""
    rng = np.random.default_rng(seed)
    outcomes, pairs = {"alarm": 0, "pass": 0, "inconclusive": 0}, []
    for _ in range(tries):
        base, cand = [], []
        for _ in range(design.max_pairs):
            b = math.exp(rng.normal(0, 0.05))  # the machine's drift: both sides alike
            base.append(b)
            cand.append(b * (1 - change) * math.exp(rng.normal(0, sigma)))
            if len(base) >= 2 and (v := sequential_look(base, cand, design)).decided:
                break
        outcomes[v.decided] += 1
        pairs.append(v.pairs)
    return {k: n / tries for k, n in outcomes.items()}, float(np.median(pairs))


@pytest.mark.parametrize("sigma", [0.04, 0.06, 0.08])
def test_the_sequential_test_keeps_its_stated_error_rates(sigma: float) -> None:
    """Per run (of 2 gated): an unchanged build alarms at most alpha / 2 = 2.5 % of the time, a
    10 % slower one passes at most beta = 10 % of the time, at the noise of 2 shared cores (about
    6 % per pair). Runs out of pairs are inconclusive: rare up to 6 %, common at 8 % for a slow run."""
    design = SequentialDesign(runs=2)
    same, same_pairs = _simulate(design, 0.0, sigma, 600, 1)
    slow, _ = _simulate(design, 0.10, sigma, 600, 2)
    assert same["alarm"] <= 0.025 + 0.02 and slow["pass"] <= 0.10 + 0.04, (same, slow)
    assert same_pairs <= 5 and same["inconclusive"] <= 0.03, same
    if sigma <= 0.06:
        assert slow["alarm"] >= 0.90 - 0.04 and slow["inconclusive"] <= 0.03, slow


def test_identical_code_with_a_low_pair_cap_is_inconclusive_not_a_failure() -> None:
    """Four noisy pairs of the same code (2 runs gated, ``--pairs 4``), 9.8 % slower on average by
    chance, interval about -54 % to +76 %: neither "at most 0 % slower" nor "10 % or more slower"
    is rejected, so the gate ends INCONCLUSIVE with its interval, neither a failure nor a pass,
    though the estimate lies nearer to "10 % slower"."""
    design = SequentialDesign(min_pairs=4, max_pairs=4, runs=2)
    base = [100.0, 96.0, 103.0, 99.0]
    v = sequential_look(base, [b * f for b, f in zip(base, (0.705, 1.185, 0.80, 0.99), strict=True)], design)
    assert v.change == pytest.approx(-0.098, abs=0.001) and v.low < -0.5 and v.high > 0.7
    assert math.log(1 + v.change) < math.log(1 - design.detect) / 2  # nearer the slowdown than no change
    assert v.p_alarm >= design.alarm_level and v.p_pass >= design.pass_level  # neither rejected
    assert v.decided == "inconclusive" and not v.alarm and not v.early
    text = v.describe()
    assert text.startswith(f"9.8% slower (interval {v.low:+.1%} to {v.high:+.1%}); inconclusive: not decided by 4")
    assert "judged there" not in text


def test_pairs_too_noisy_for_a_float_bound_are_inconclusive_not_a_crash() -> None:
    """2 pairs at alpha 0.001 (one degree of freedom: t = 637) whose ratios lie 12-fold apart, as a
    CPU hogged on one half makes them side by side: the interval's top is past a float's range; the
    verdict is INCONCLUSIVE, "over +1000%", not an OverflowError (which ``gate`` exits 1 on)."""
    design = SequentialDesign(alpha=0.001, beta=0.001, min_pairs=2, max_pairs=2)
    v = sequential_look([1.0, 1.0], [3.5, 1 / 3.5], design)
    assert v.decided == "inconclusive" and v.high == math.inf
    assert "(interval -100.0% to over +1000%); inconclusive: not decided by 2 pairs" in v.describe()


def test_an_undecided_run_at_the_pair_cap_is_never_judged() -> None:
    """Identical-on-average noisy pairs with a cap of 4: every run not rejected either way ends
    inconclusive, however its estimate leans; only a crossed boundary alarms or passes."""
    design = SequentialDesign(min_pairs=4, max_pairs=4, runs=2)
    rng = np.random.default_rng(11)
    leaning_slow = 0
    for _ in range(300):
        base = [100 * math.exp(rng.normal(0, 0.05)) for _ in range(4)]
        v = sequential_look(base, [b * math.exp(rng.normal(0, 0.2)) for b in base], design)
        if v.p_alarm >= design.alarm_level and v.p_pass >= design.pass_level:
            assert v.decided == "inconclusive", v.describe()
            leaning_slow += v.change < -0.05  # where a rule judging at the cap would have alarmed
        else:
            assert v.decided in ("alarm", "pass") and v.early
    assert leaning_slow >= 50  # the case is common at this noise, not a corner


def test_the_inconclusive_exit_code_is_its_own() -> None:
    assert EXIT_INCONCLUSIVE not in (EXIT_PASS, EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_INFRA)


def test_a_slowdown_alarms_early_and_noise_passes_early() -> None:
    base = [100.0, 104.0, 97.0, 101.0]
    design = SequentialDesign(runs=3)
    slow = sequential_look(base, [b * f for b, f in zip(base, (0.80, 0.82, 0.79, 0.81), strict=True)], design)
    assert slow.alarm and slow.early and slow.change == pytest.approx(-0.2, abs=0.01) and slow.high < -0.15
    assert "19.5% slower" in slow.describe() and "decided after 4 pairs" in slow.describe()
    same = sequential_look(base, [b * f for b, f in zip(base, (1.01, 0.99, 1.0, 1.01), strict=True)], design)
    assert same.decided == "pass" and same.early and same.detectable < 0.06
    assert "could have detected a" in same.describe()
    wide = sequential_look(base, [b * f for b, f in zip(base, (1.2, 0.8, 1.0, 0.9), strict=True)], design)
    assert wide.decided is None  # too noisy to say either: more pairs
    with pytest.raises(ValueError, match="at least two pairs"):
        sequential_look([1.0], [1.0], design)
    with pytest.raises(ValueError, match="min_pairs"):
        SequentialDesign(min_pairs=4, max_pairs=3)


def test_it_looks_only_where_both_orders_have_run_equally_often() -> None:
    """Pair k runs the baseline first when k is even: a side that gains 4 % by running second
    shows as +4 %, -4 %, ... in the pairs; at an even count that cancels, at an odd count it would
    not, and the test does not decide there."""
    design = SequentialDesign(runs=1)
    assert design.looks == (4, 6, 8, 10) and SequentialDesign(min_pairs=3, max_pairs=8).looks == (3, 5, 7, 8)
    base = [100.0, 103.0, 98.0, 101.0, 99.0]
    order = [1.04 if k % 2 == 0 else 1 / 1.04 for k in range(5)]
    slow = [b * 0.8 * f for b, f in zip(base, order, strict=True)]
    assert sequential_look(base[:4], slow[:4], design).alarm
    assert sequential_look(base, slow, design).decided is None  # 5 pairs: not a look, whatever they show
    even = sequential_look(base[:4], [b * f for b, f in zip(base, order[:4], strict=False)], design)
    assert even.change == pytest.approx(0.0, abs=1e-9) and even.decided == "pass"
    assert even.pair_note() == ("pairs +4.0% -3.8% +4.0% -3.8% (the baseline first in the 1st, 3rd, ...); "
                                "running second changed a side's speed by +4.0%")


@pytest.mark.ranks
@pytest.mark.full  # --against a revision, in turns: the undecided gate below, in every session
def test_gate_against_a_revision_runs_both_sides_in_turns(tmp_path: Path) -> None:
    if shutil.which("git") is None or subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO,
                                                      capture_output=True).returncode != 0:
        pytest.skip("needs git and this checkout's history")
    scenario = REPO / "examples" / "minimal_parity.toml"  # 10 steps of 1 and 2 ranks (speed_gate's 40: the same gate)
    committed = subprocess.run(["git", "cat-file", "-e", "HEAD:examples/minimal_parity.toml"], cwd=REPO).returncode == 0
    if not committed:
        pytest.skip("examples/minimal_parity.toml is not committed yet")
    p = cli("gate", "--against", "HEAD", str(scenario), "--in-turns", "--pairs", "2", "--min-pairs", "2", timeout=900)
    assert p.returncode in (0, 1, 4), p.stderr[-3000:]
    assert "gate against HEAD (" in p.stdout and ", 2 interleaved pairs (sequential, 2 to 2):" in p.stdout
    for run in ("single", "ddp2"):
        line = next(ln for ln in p.stdout.splitlines() if ln.startswith("minimal_parity") and f" {run} " in ln
                    and "throughput (paired)" in ln)
        assert "p = " in line and " 2 pairs" in line and "could have detected a" in line
        assert any(ln.startswith("minimal_parity") and f" {run} " in ln and " loss " in ln
                   for ln in p.stdout.splitlines())
    assert p.stderr.count("pair 2/2: ") == 2 and p.stderr.index("pair 2/2: candidate") < p.stderr.index(
        "pair 2/2: baseline")  # the second pair runs the candidate first
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    assert "mlx-ddp-harness-against-" not in worktrees  # the temporary worktree is gone


def _git_repo(root: Path) -> Path:
    """A git repository of one commit holding a one-process scenario of 4 steps."""
    root.mkdir()
    write_scenario(root, "tiny", (1,), steps=4)
    for args in (["init", "-q"], ["add", "tiny.toml"], ["-c", "user.name=t", "-c", "user.email=t@example.com",
                                                         "commit", "-q", "-m", "tiny"]):
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)
    return root


@pytest.mark.ranks
def test_a_gate_that_cannot_decide_by_its_last_pair_reports_inconclusive(tmp_path: Path) -> None:
    """Identical code, 2 pairs at error rates of 0.001 (one degree of freedom): a run is decided
    only when its two pair ratios agree to about a thousandth of their mean's distance from a
    boundary, so nearly every gate says INCONCLUSIVE with the interval, exits 4, and its record and
    job summary say so; the regression table names each side's revisions and both speeds. A gate
    that does decide (a load that slows the middle two of the four runs makes both pairs show
    the same change) must say why with p below its level; the gate is then run again, 3 times
    at most."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    repo = _git_repo(tmp_path / "repo")
    for attempt in range(3):
        summary, out = tmp_path / f"summary{attempt}.md", tmp_path / f"gate{attempt}"
        t0 = time.monotonic()
        p = cli("gate", "--against", "HEAD", "tiny.toml", "--pairs", "2", "--min-pairs", "2", "--alpha", "0.001",
                "--beta", "0.001", "--out", str(out), cwd=repo, timeout=300,
                env={"GITHUB_STEP_SUMMARY": str(summary)})
        took = time.monotonic() - t0
        if p.returncode == EXIT_INCONCLUSIVE:
            break
        said = p.stdout[-3000:] + p.stderr[-2000:]
        assert p.returncode in (EXIT_PASS, EXIT_CHECK_FAILED) and "Traceback" not in p.stderr, said  # 1: not a crash
        speed = next((ln for ln in p.stdout.splitlines() if ln.startswith("tiny ") and "throughput (paired)" in ln),
                     None)
        assert speed is not None and "decided after 2 pairs" in speed, said
        num = r"([0-9.e+-]+)"
        got = re.search(rf"p = {num} that it is at most 0% slower \(alarm below {num}\), "
                        rf"p = {num} that it is 10% or more slower \(pass below {num}\)", speed)
        assert got, speed
        p_alarm, alarm_level, p_pass, pass_level = (float(x) for x in got.groups())
        assert (p_alarm < alarm_level) if p.returncode == EXIT_CHECK_FAILED else (p_pass < pass_level), speed
    else:
        pytest.fail(f"3 gates of identical code were all decided; the last: {p.stdout[-3000:]}")
    head = p.stdout.splitlines()[0]
    assert head.startswith("gate against HEAD (") and ": INCONCLUSIVE (" in head and "1 inconclusive)" in head, head
    assert "PASSED" not in p.stdout and "FAILED" not in p.stdout
    speed = next(ln for ln in p.stdout.splitlines() if ln.startswith("tiny ") and "throughput (paired)" in ln)
    assert " INCONCLUSIVE " in speed and "(interval " in speed and "not decided by 2 pairs" in speed, speed
    assert "fastest-tenth tok/s" in speed
    assert any(ln.startswith("INCONCLUSIVE tiny/single throughput (paired): ") for ln in p.stdout.splitlines())
    assert "rerun with a larger --pairs" in p.stdout
    mode = pair_mode(argparse.Namespace(side_by_side=False, in_turns=False, device=None))  # the default here
    assert f"note: {mode.line()}" in p.stdout, p.stdout[-2000:]
    assert f", 2 {'side-by-side' if mode.side_by_side else 'interleaved'} pairs " in head, head
    record = json.loads((out / "gate.json").read_text())
    assert record["verdict"] == "inconclusive" and record["exit_code"] == 4 and record["passed"] is False
    assert {g["metric"]: g["result"] for g in record["gates"]}["throughput (paired)"] == "INCONCLUSIVE"
    assert all(g["result"] == "pass" for g in record["gates"] if g["metric"] != "throughput (paired)")
    assert ": INCONCLUSIVE (" in summary.read_text() and "| INCONCLUSIVE " in summary.read_text()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                            text=True).stdout.strip()
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("qwen3 ") and " tiny " in ln and " single " in ln]
    assert len(rows) == 2, rows  # the regression table: the baseline side, then this checkout
    assert f"HEAD ({commit}; harness " in rows[0] and f"this checkout ({commit}; harness " in rows[1], rows
    assert "Gated speed: fastest-tenth tok/s" in p.stdout and "Post-step-1 median tok/s" in p.stdout
    assert "mlx-ddp-harness-against-" not in subprocess.run(["git", "worktree", "list"], cwd=repo,
                                                            capture_output=True, text=True).stdout
    assert took < 120, took


def _span(result_dir: Path) -> tuple[float, float]:
    """When a side's runs trained: the first and last event time of its ranks."""
    times = [json.loads(ln)["time"] for run in json.loads((result_dir / "result.json").read_text())["scenarios"][0][
        "runs"] for f in Path(run["artifacts"]).glob("rank*.events.jsonl") for ln in f.read_text().splitlines()]
    return min(times), max(times)


@pytest.mark.ranks
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pins each side to its own CPUs")
def test_side_by_side_pairs_run_both_sides_at_once_each_on_its_own_half_of_the_cpus(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("needs git")
    repo = tmp_path / "repo"
    repo.mkdir()
    write_scenario(repo, "tiny", (1, 2), steps=6)
    for args in (["init", "-q"], ["add", "tiny.toml"], ["-c", "user.name=t", "-c", "user.email=t@example.com",
                                                         "commit", "-q", "-m", "tiny"]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    out = repo / "gate-out"  # given relative, as a CI step gives it: each side runs in its own tree
    p = cli("gate", "--against", "HEAD", "tiny.toml", "--side-by-side", "--pairs", "2", "--min-pairs", "2",
            "--out", "gate-out", cwd=repo, timeout=300)
    assert p.returncode in (EXIT_PASS, EXIT_CHECK_FAILED, EXIT_INCONCLUSIVE), p.stdout[-3000:] + p.stderr[-2000:]
    assert ", 2 side-by-side pairs (sequential, 2 to 2):" in p.stdout.splitlines()[0], p.stdout[:500]
    assert p.stderr.count("both sides done, side by side") == 2, p.stderr
    assert "(side by side, the baseline on the first half of the CPUs in the 1st, 3rd, ...)" in p.stdout
    half = len(os.sched_getaffinity(0)) // 2
    for k in (0, 1):
        (b0, b1), (c0, c1) = _span(out / "pairs" / f"baseline{k}"), _span(out / "pairs" / f"candidate{k}")
        assert max(b0, c0) < min(b1, c1), (b0, b1, c0, c1)  # the two sides trained at the same time
        for side in ("baseline", "candidate"):
            assert (out / "pairs" / f"{side}{k}.log").is_file()
            ddp2 = next(r for r in json.loads((out / "pairs" / f"{side}{k}" / "result.json").read_text())[
                "scenarios"][0]["runs"] if r["name"] == "ddp2")
            assert ddp2["queued_s"] < 1.0, ddp2["queued_s"]  # its own rank budget: it never waits for the other side
            if half < 2:  # pinned to its half: both ranks on one core (so they yield it while they wait)
                assert f"2 ranks on {half} cores" in ddp2["ring_yield"], ddp2["ring_yield"]


@pytest.mark.skipif(shutil.which("taskset") is None or shutil.which("git") is None, reason="needs taskset and git")
def test_side_by_side_on_one_cpu_is_one_line(tmp_path: Path) -> None:
    repo = _git_repo(tmp_path / "repo")
    p = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "harness", "gate", "--against", "HEAD", "tiny.toml",
                        "--side-by-side"], cwd=repo, capture_output=True, text=True, timeout=120)
    assert p.returncode == EXIT_BAD_INPUT and p.stderr == (
        "error: --side-by-side: needs at least 2 CPUs to give each side its own, this process has 1\n"), p.stderr
    assert "mlx-ddp-harness-against-" not in subprocess.run(["git", "worktree", "list"], cwd=repo,
                                                            capture_output=True, text=True).stdout


def test_pairs_run_side_by_side_by_default_only_where_the_cpu_computes_and_speed_is_judged() -> None:
    def mode(device: str | None = None, speed: bool = True, **asked: bool) -> PairMode:
        flags = {"side_by_side": False, "in_turns": False, **asked}
        return pair_mode(argparse.Namespace(device=device, **flags), speed_judged=speed)

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    on_cpu = mode("cpu")
    assert on_cpu.side_by_side == (cpus >= 2), on_cpu
    if cpus >= 2:
        assert f"each side on its own half of this process's {cpus} CPUs" in on_cpu.why
    gpu = mode("gpu")  # a GPU (two sides at once would share it), or one asked for and absent
    assert not gpu.side_by_side and ("share" in gpu.why or gpu.why == "--device gpu, which MLX does not see here")
    assert not mode("cpu", speed=False).side_by_side and "kept results can be reused" in mode("cpu", speed=False).why
    assert mode("gpu", side_by_side=True).side_by_side and not mode("cpu", in_turns=True).side_by_side
    assert mode("cpu", in_turns=True).line() == "each pair's two sides run in turns: --in-turns asked for it"
    if cpus >= 2:  # pinned to one CPU, this process cannot give each side its own
        mine = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(mine)})
        try:
            one = mode("cpu")
        finally:
            os.sched_setaffinity(0, mine)
        assert not one.side_by_side and one.why == "the runs compute on the CPU, and this process has one CPU"


def test_without_device_the_pairs_follow_each_runs_own_device(tmp_path: Path) -> None:
    def mode(*scenarios: Path, device: str | None = None) -> PairMode:
        args = argparse.Namespace(device=device, side_by_side=False, in_turns=False)
        return pair_mode(args, scenarios=[str(s) for s in scenarios])

    on_cpu = write_scenario(tmp_path, "on_cpu", world_sizes=(1,), extra='train = { device = "cpu" }\n')
    on_gpu = write_scenario(tmp_path, "on_gpu", world_sizes=(2,), extra='train = { device = "gpu" }\n')
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    assert mode(on_cpu).side_by_side == (cpus >= 2)  # a run that asks for the CPU, on any machine
    from harness.controller.devices import accelerators

    gpu = mode(on_cpu, on_gpu)
    assert not gpu.side_by_side  # its run asks for the GPU: the sides would share it, or it is not here
    if accelerators().kind == "cpu":
        assert gpu.why == f"{on_gpu}'s run ddp2 asks for device gpu, which MLX does not see here", gpu.why
    else:
        assert gpu.why.startswith(f"the runs compute on the GPU ({on_gpu}'s run ddp2), which two sides"), gpu.why
    assert mode(on_cpu, on_gpu, device="cpu").side_by_side == (cpus >= 2)  # --device decides for every run


def test_gate_against_a_bad_revision_is_one_line(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("needs git")
    repo = _git_repo(tmp_path / "repo")
    p = cli("gate", "--against", "no-such-rev", "tiny.toml", cwd=repo)
    assert p.returncode == 2 and p.stderr == f"error: no-such-rev: no such revision in {repo.resolve()}\n", p.stderr


@pytest.mark.parametrize(("args", "needle"), [
    (["--against", "no-such-revision-x"], f"no-such-revision-x: no such revision in {REPO}"),
    (["--against", "HEAD", "--pairs", "1"], "--pairs must be at least 2"),
    (["--against", "HEAD", "--min-pairs", "12"], "--min-pairs must be from 2 to --pairs (10), got 12"),
    (["--against", "HEAD", "--detect", "3", "--slowdown-margin", "5"], "must be below --detect (3)"),
    (["--against", "HEAD", "--baseline", "x"], "give --baseline or --against, not both"),
    (["--baseline", "x", "--side-by-side"], "--side-by-side is for a gate that runs scenarios itself"),
    (["--baseline", "x", "--in-turns"], "--in-turns is for a gate that runs scenarios itself"),
    (["--against", "HEAD", "--side-by-side", "--in-turns"], "give --side-by-side or --in-turns, not both"),
    ([], "gate needs --baseline FILE"),
])
def test_gate_against_refuses_bad_input_with_one_line(args: list[str], needle: str) -> None:
    p = cli("gate", str(REPO / "scenarios" / "speed_gate.toml"), *args)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and needle in p.stderr, p.stderr


def test_gate_against_needs_a_git_repository(tmp_path: Path) -> None:
    (tmp_path / "s.toml").write_text("")
    p = cli("gate", "--against", "HEAD", str(tmp_path / "s.toml"), cwd=tmp_path,
            env={"GIT_CEILING_DIRECTORIES": str(tmp_path.parent)})
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith(f"error: not a git repository: {tmp_path}"), p.stderr
    assert "fatal:" not in p.stderr  # not git's own message

