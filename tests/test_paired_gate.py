"""``gate --against REV``: the paired speed test (pure logic) and the whole command against a
revision of this repository, with real runs on both sides."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.judge.paired import paired_speed
from tests.conftest import REPO, cli


def test_the_paired_test_uses_students_t_as_its_tables_give_it() -> None:
    """Five pairs whose log ratios have mean -0.1 and standard error 0.0316: the 95 % interval's
    half-width is t(0.975, 4) = 2.776 standard errors, and "at most 5 % slower" has p = P(T4 < -1.54)."""
    logs = [-0.1, -0.2, 0.0, -0.1, -0.1]
    v = paired_speed([1.0] * 5, [math.exp(x) for x in logs], margin=0.05, alpha=0.05)
    se = math.sqrt(0.005 / 5)
    assert v.low == pytest.approx(math.exp(-0.1 - 2.776 * se) - 1, abs=2e-4)
    assert v.high == pytest.approx(math.exp(-0.1 + 2.776 * se) - 1, abs=2e-4)
    assert v.p_value == pytest.approx(0.0992, abs=2e-3) and not v.alarm  # t(0.90, 4) = 1.533


def test_a_paired_slowdown_beyond_the_margin_alarms_and_noise_does_not() -> None:
    base = [100.0, 104.0, 97.0, 101.0, 99.0]
    slow = paired_speed(base, [b * f for b, f in zip(base, (0.80, 0.82, 0.79, 0.81, 0.78), strict=True)],
                        runs_gated=3)
    assert slow.alarm and slow.change == pytest.approx(-0.2, abs=0.01) and slow.high < -0.15
    assert slow.level == pytest.approx(0.05 / 3) and slow.p_value < slow.level
    assert "20.0% slower" in slow.describe() and "5 interleaved pairs" in slow.describe()
    same = paired_speed(base, [b * f for b, f in zip(base, (1.03, 0.97, 1.01, 0.98, 1.02), strict=True)],
                        runs_gated=3)
    assert not same.alarm and same.low < 0 < same.high
    within = paired_speed(base, [b * 0.97 for b in base])  # 3% slower, every pair alike: within the margin
    assert not within.alarm and math.isclose(within.change, -0.03, abs_tol=1e-9)
    with pytest.raises(ValueError, match="at least two pairs"):
        paired_speed([1.0], [1.0])


@pytest.mark.ranks
def test_gate_against_a_revision_runs_both_sides_in_turns(tmp_path: Path) -> None:
    if shutil.which("git") is None or subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO,
                                                      capture_output=True).returncode != 0:
        pytest.skip("needs git and this checkout's history")
    scenario = REPO / "scenarios" / "speed_gate.toml"
    committed = subprocess.run(["git", "cat-file", "-e", "HEAD:scenarios/speed_gate.toml"], cwd=REPO).returncode == 0
    if not committed:
        pytest.skip("scenarios/speed_gate.toml is not committed yet")
    p = cli("gate", "--against", "HEAD", str(scenario), "--pairs", "2", timeout=900)
    assert p.returncode in (0, 1), p.stderr[-3000:]
    assert "gate against HEAD (" in p.stdout and ", 2 interleaved pairs:" in p.stdout
    for run in ("single", "ddp2"):
        line = next(ln for ln in p.stdout.splitlines() if ln.startswith("speed_gate") and f" {run} " in ln
                    and "throughput (paired)" in ln)
        assert "p = " in line and "interleaved pairs" in line
        assert any(ln.startswith("speed_gate") and f" {run} " in ln and " loss " in ln for ln in p.stdout.splitlines())
    assert p.stderr.count("pair 2/2: ") == 2 and p.stderr.index("pair 2/2: candidate") < p.stderr.index(
        "pair 2/2: baseline")  # the second pair runs the candidate first
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    assert "mlx-ddp-harness-against-" not in worktrees  # the temporary worktree is gone


@pytest.mark.parametrize(("args", "needle"), [
    (["--against", "no-such-revision-x"], "--against no-such-revision-x: not a revision of the git repository"),
    (["--against", "HEAD", "--pairs", "1"], "--pairs must be at least 2"),
    (["--against", "HEAD", "--baseline", "x"], "give --baseline or --against, not both"),
    ([], "gate needs --baseline FILE"),
])
def test_gate_against_refuses_bad_input_with_one_line(args: list[str], needle: str) -> None:
    p = cli("gate", str(REPO / "scenarios" / "speed_gate.toml"), *args)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and needle in p.stderr, p.stderr


def test_gate_against_needs_a_git_repository(tmp_path: Path) -> None:
    (tmp_path / "s.toml").write_text("")
    p = cli("gate", "--against", "HEAD", str(tmp_path / "s.toml"), cwd=tmp_path,
            env={"GIT_CEILING_DIRECTORIES": str(tmp_path.parent)})
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "git rev-parse --show-toplevel" in p.stderr, p.stderr
