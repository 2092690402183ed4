"""``gate --bisect GOOD..BAD`` on real ranks, in a scratch repository of the project (its
``harness`` package and a small scenario): a slowdown planted in one commit among docs-only
ones is named, a range before it holds no regression, a parity defect is named by its failing
check, and bad input is one line."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.exit_codes import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_PASS
from tests.conftest import REPO, write_scenario

NO_ALLREDUCE = ("        return nn.average_gradients(grads, group=self.group)\n",
                "        return grads\n")  # the gradient's all-reduce left out: each rank trains on its own rows


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def _commit(repo: Path, subject: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", subject)
    return _git(repo, "rev-parse", "HEAD")


def _docs(repo: Path, n: int) -> str:
    with open(repo / "NOTES.md", "a") as f:
        f.write(f"note {n}\n")
    return _commit(repo, f"docs: note {n}")


def _scratch(root: Path, world_sizes: tuple[int, ...]) -> Path:
    """A git repository of the project's ``harness`` package and a scenario of 6 steps: its first commit."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    repo = root / "repo"
    shutil.copytree(REPO / "harness", repo / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    write_scenario(repo, "tiny", world_sizes, steps=6)
    (repo / "NOTES.md").write_text("notes\n")
    _git(repo, "init", "-q")
    _commit(repo, "the harness and a scenario")
    return repo


def _bisect(repo: Path, spec: str, *flags: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = repo.parent / f"out-{spec.replace('.', '_')[:24]}"
    env = {**os.environ, "MLX_DDP_HARNESS_CACHE": str(repo.parent / "cache"),  # the commits' kept results
           "GITHUB_STEP_SUMMARY": str(out.with_suffix(".summary.md"))}
    p = subprocess.run([sys.executable, "-m", "harness", "gate", "--bisect", spec, "tiny.toml", "--out", str(out),
                        *flags], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    record = out / "bisect.json"
    return p, json.loads(record.read_text()) if record.exists() else None


@pytest.mark.ranks
@pytest.mark.full  # about 20 runs of a scenario, in four probes
def test_a_slowdown_planted_among_docs_commits_is_named_and_a_range_before_it_holds_none(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gate_power", REPO / "benchmarks" / "gate_power.py")
    gate_power = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gate_power)
    repo = _scratch(tmp_path, (1,))
    good = _git(repo, "rev-parse", "HEAD")
    for n in (1, 2):
        _docs(repo, n)
    before = _git(repo, "rev-parse", "HEAD")
    gate_power.slowed(repo, 0.6)  # each step 2.5 times as long
    slow = _commit(repo, "reference: a step that sleeps")
    for n in (3, 4):
        _docs(repo, n)
    # beside other tests' ranks: a coarse question (not 40 % slower?) that 4 pairs answer alone, and
    # up to 8 where those ranks widen the interval (it then says more pairs would decide); in turns,
    # so that a commit probed again reuses its kept runs
    coarse = ("--min-pairs", "4", "--pairs", "8", "--detect", "40", "--slowdown-margin", "10", "--in-turns")
    p, record = _bisect(repo, f"{good[:10]}..", *coarse)
    assert p.returncode == EXIT_CHECK_FAILED, p.stdout[-3000:] + p.stderr[-2000:]
    assert f'first bad commit: {slow[:12]} "reference: a step that sleeps"' in p.stdout, p.stdout
    assert record["answer"]["first_bad"]["sha"] == slow and record["exit_code"] == EXIT_CHECK_FAILED
    probes = record["probes"]
    assert probes[0]["index"] == 5 and probes[0]["outcome"] == "bad"  # BAD confirmed first
    assert all(p_["metric"].startswith("throughput (paired) tiny/single") for p_ in probes if p_["outcome"] == "bad")
    assert {p_["outcome"] for p_ in probes} <= {"bad", "good"} and len(probes) <= 4
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("probe ")]
    assert len(lines) == len(probes) and lines[0].startswith("probe 1 (BAD): ")
    assert "slower" in p.stdout.split("first bad commit:")[1]
    assert list((tmp_path / f"out-{good[:10]}__").glob("probes/01-*/candidate0/result.json"))  # every probe's runs
    assert "mlx-ddp-harness-bisect-" not in _git(repo, "worktree", "list")

    p, record = _bisect(repo, f"{good[:10]}..{before[:10]}", *coarse)
    assert p.returncode == EXIT_PASS, p.stdout[-3000:] + p.stderr[-2000:]
    assert record["answer"]["kind"] == "none" and len(record["probes"]) == 1
    first = {x["commit"]["sha"]: x["runs"] // 2 for x in probes}  # each probe's pairs
    if before in first:  # probed in the first bisection: its own runs are reused, its baseline's run again
        pairs = record["probes"][0]["runs"] // 2
        reused = p.stderr.count(": candidate reused")
        assert reused == min(first[before], pairs) >= 4 and p.stderr.count(": baseline done") == pairs, p.stderr
    assert "no regression in the range" in p.stdout


@pytest.mark.ranks  # 8 runs of a 1- and 2-rank scenario, in two probes
def test_a_parity_defect_planted_in_a_commit_is_named_by_its_failing_check(tmp_path: Path) -> None:
    repo = _scratch(tmp_path, (1, 2))
    good = _git(repo, "rev-parse", "HEAD")
    semantics = repo / "harness" / "trainers" / "reference" / "semantics.py"
    text = semantics.read_text()
    assert text.count(NO_ALLREDUCE[0]) == 1
    semantics.write_text(text.replace(*NO_ALLREDUCE))
    broken = _commit(repo, "reference: gradients not all-reduced")
    _docs(repo, 2)
    p, record = _bisect(repo, f"{good[:10]}..HEAD", "--metrics", "checks", "--min-pairs", "2", "--pairs", "2")
    assert p.returncode == EXIT_CHECK_FAILED, p.stdout[-3000:] + p.stderr[-2000:]
    assert record["answer"]["first_bad"]["sha"] == broken, p.stdout
    assert "each pair's two sides run in turns: no speed is judged" in p.stdout.splitlines()[0]  # so results are kept
    deciding = next(p_ for p_ in record["probes"] if p_["commit"]["sha"] == broken)
    assert deciding["metric"] == "checks tiny/ddp2" and "param_parity" in deciding["figure"], deciding
    # every probe's speed test ran at the bisection's false-alarm rate split over its most probes,
    # each of its two runs at half of that (one look: the level is the rate itself)
    per_probe = record["alpha"] / record["max_probes"]
    for probe in record["probes"]:
        assert probe["speed_test"]["alpha"] == pytest.approx(per_probe), probe
        assert probe["speed_test"]["runs"] == 2 and probe["speed_test"]["alarm_level"] == pytest.approx(per_probe / 2)
    summary = next(tmp_path.glob("out-*.summary.md")).read_text()  # the job summary: the probes' table, the answer
    assert summary.startswith("### gate --bisect ") and "| Probe | Commit | Outcome |" in summary
    assert f"first bad commit: {broken[:12]}" in summary


def test_bisect_options_without_a_bisection_are_one_line(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "harness", "gate", "--against", "HEAD", "x.toml", "--metrics", "speed"],
                       cwd=REPO, capture_output=True, text=True)
    assert p.returncode == EXIT_BAD_INPUT and "--metrics is for --bisect or --bisect-versions" in p.stderr, p.stderr


def test_a_good_off_the_first_parent_line_is_refused_in_one_line(tmp_path: Path) -> None:
    repo = _scratch(tmp_path, (1,))
    _git(repo, "checkout", "-q", "-b", "side")
    (repo / "SIDE.md").write_text("a side branch\n")
    side = _commit(repo, "docs: a side branch")
    _git(repo, "checkout", "-q", "-")
    _docs(repo, 2)
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "merge", "-q", "--no-ff", "-m", "merge", "side")
    p, _ = _bisect(repo, f"{side[:10]}..HEAD")
    assert p.returncode == EXIT_BAD_INPUT and "is not on HEAD's first-parent line" in p.stderr, p.stderr


@pytest.mark.parametrize(("spec", "needle"), [
    ("HEAD", "give GOOD..BAD"),
    ("nosuchrev..", "nosuchrev: no such revision"),
    ("HEAD..HEAD", "no commit after HEAD"),
])
def test_bad_bisect_input_is_one_line(tmp_path: Path, spec: str, needle: str) -> None:
    repo = _scratch(tmp_path, (1,))
    p, _ = _bisect(repo, spec)
    assert p.returncode == EXIT_BAD_INPUT and needle in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
