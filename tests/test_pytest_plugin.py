"""The pytest plugin (``harness.present.pytest_plugin``, installed as a ``pytest11`` entry point):
scenario files collected as tests, their verdicts as outcomes, the ``mlx_ddp`` fixture, and
xdist keeping a scenario's tests on one worker. Each case runs a separate pytest in a
subprocess, as a user's CI would."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.scenario import load_scenario
from harness.scenario.plan import plan_scenario
from tests.conftest import write_scenario


def _pytest(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, **(env or {})}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=600)


def _default(path: Path) -> Path:
    path.write_text(path.read_text().replace("seed = 7\n", "seed = 7\ndefault = true\n", 1))
    return path


def _ids(p: subprocess.CompletedProcess) -> list[str]:
    return [line for line in p.stdout.splitlines() if "::" in line]


def test_scenario_files_are_collected_only_where_asked(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    _default(write_scenario(suite, "shipped", (1, 2)))
    write_scenario(suite, "optional", (1, 2))  # not in the default set
    (suite / "settings.toml").write_text("[tool]\nx = 1\n")  # a TOML file that is no scenario
    (tmp_path / "test_plain.py").write_text("def test_one():\n    assert True\n")

    p = _pytest(tmp_path, "suite", "--collect-only", "-q")
    ids = _ids(p)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "suite/shipped.toml::single::launch" in ids and "suite/shipped.toml::ddp2::loss_parity" in ids
    assert not any("settings" in i for i in ids)
    # a directory means its default set; another scenario file there is one skipped test saying so
    assert [i for i in ids if "optional" in i] == ["suite/optional.toml::not_in_default_set"]
    skipped = _pytest(tmp_path, "suite/", "-rs", "-k", "not_in_default_set")
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    assert "optional.toml has no default = true: a directory runs its default set; name the file" in skipped.stdout
    assert "suite/shipped.toml::ddp2::param_parity" in ids and "suite/shipped.toml::single::loss_parity" not in ids

    named = _ids(_pytest(tmp_path, "suite/optional.toml", "--collect-only", "-q"))
    assert named and all(i.startswith("suite/optional.toml::") for i in named)  # a file named is collected

    plain = _ids(_pytest(tmp_path, "test_plain.py", "--collect-only", "-q"))
    assert plain == ["test_plain.py::test_one"]  # off unless used
    walked = _ids(_pytest(tmp_path, "--mlx-ddp", "--collect-only", "-q"))
    assert "test_plain.py::test_one" in walked and any(i.startswith("suite/shipped.toml::") for i in walked)

    selected = _ids(_pytest(tmp_path, "suite", "-k", "loss_parity and not step_", "--collect-only", "-q"))
    assert selected == ["suite/shipped.toml::ddp2::loss_parity"]


def test_a_malformed_scenario_is_one_collection_error_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[scenario]\nname = "bad"\ndescription = "x"\ndefault = true\n[train]\nsteps = "many"\n')
    p = _pytest(tmp_path, "bad.toml", "-q")
    assert p.returncode == 2, p.stdout
    assert re.search(r"bad scenario: .*bad\.toml", p.stdout), p.stdout
    assert "Traceback" not in p.stdout


@pytest.mark.ranks
def test_every_check_is_a_test_case_and_failures_name_value_limit_and_cause(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    _default(write_scenario(suite, "tight", (1, 2), steps=3, checks="max_rss_mb = 1"))
    _default(write_scenario(suite, "crash", (1, 2), steps=3, extra=(
        '\n[[faults]]\nrank = 1\nstep = 2\nphase = "fetch"\naction = "exit"\ncode = 3\nruns = ["ddp2"]\n')))
    _default(write_scenario(suite, "marked", (1, 2), steps=3, checks=(
        "max_rss_mb = 1\n[checks.expected_failures]\nmemory_rss_per_rank_mb = \"a ceiling no run meets\"\n"
        "token_accounting = { ddp2 = \"marked, yet it passes\" }")))
    junit = tmp_path / "junit.xml"
    p = _pytest(tmp_path, "suite", f"--junitxml={junit}", "--mlx-ddp-out", str(tmp_path / "out"), "-rxs")
    assert p.returncode == 1, p.stdout + p.stderr

    cases = {f"{c.get('classname')}::{c.get('name')}": c for c in ET.parse(junit).getroot().iter("testcase")}
    outcome = {k: ("failure" if c.find("failure") is not None else "skipped" if c.find("skipped") is not None
                   else "passed") for k, c in cases.items()}
    assert outcome["suite.tight.toml.ddp2::loss_parity"] == "passed"
    failure = cases["suite.tight.toml.ddp2::memory_rss_per_rank_mb"].find("failure").get("message")
    assert re.search(r"memory_rss_per_rank_mb \(ddp2\): [\d.]+ > limit 1; per rank", failure), failure
    assert outcome["suite.crash.toml.single::launch"] == "passed"
    # JUnit carries the measured figures: a check's value and limit, a run's times (its queue wait too)
    props = {k: {p.get("name"): p.get("value") for p in c.iter("property")} for k, c in cases.items()}
    rss = props["suite.tight.toml.ddp2::memory_rss_per_rank_mb"]
    assert float(rss["value"]) > float(rss["limit"]) == 1 and rss["result"] == "FAIL"
    launch = props["suite.tight.toml.ddp2::launch"]
    assert launch["world_size"] == "2" and float(launch["wall_s"]) > 0 and float(launch["queued_s"]) >= 0
    assert float(launch["median_tok_s"]) > 0 and launch["backend"] == "ring"
    crash = cases["suite.crash.toml.ddp2::launch"].find("failure").get("message")
    assert "run ddp2 (world size 2) did not complete: rank 1 ended with exit code 3" in crash
    assert outcome["suite.crash.toml.ddp2::loss_parity"] == "skipped"
    # an expected failure that fails is xfail (junit: skipped); one that passes is XPASS(strict)
    assert outcome["suite.marked.toml.ddp2::memory_rss_per_rank_mb"] == "skipped"
    assert outcome["suite.marked.toml.ddp2::token_accounting"] == "failure"
    assert "[XPASS(strict)] marked, yet it passes" in cases["suite.marked.toml.ddp2::token_accounting"].find(
        "failure").get("message")
    assert "XFAIL suite/marked.toml::ddp2::memory_rss_per_rank_mb - a ceiling no run meets" in p.stdout
    # the report of a failure: the scenario's check table and its artifacts
    assert re.search(r"memory_rss_per_rank_mb\s+ddp2\s+[\d.]+\s+-\s+-\s+1\s+FAIL", p.stdout)
    assert f"artifacts: {tmp_path / 'out' / 'tight'}" in p.stdout
    # the closing block: scenarios and tests by outcome (XPASS(strict) is a failure), and the artifacts
    summary = p.stdout[p.stdout.index("mlx-ddp summary"):].splitlines()
    # marked's single run may stay within the 1 MB ceiling or rise past it (an expected failure too)
    assert re.fullmatch(r"3 scenarios: 0 passed, 3 failed, 0 skipped; tests: \d+ passed, [12] expected failures "
                        r"shown, \d+ skipped, [3-9] FAILED", summary[1]), summary
    assert f"artifacts: {tmp_path / 'out'}" in summary[2:4]  # after a rank-slot line when runs queued
    assert (tmp_path / "out" / "tight" / "result.json").is_file()
    assert (tmp_path / "out" / "tight" / "runs" / "ddp2" / "rank1.events.jsonl").is_file()  # OUT/<scenario>/runs/<run>
    assert "Traceback" not in p.stdout
    # the checks collected before the runs are exactly the checks judged after them
    for name in ("tight", "marked"):
        (s,) = json.loads((tmp_path / "out" / name / "result.json").read_text())["scenarios"]
        judged: dict[str, list[str]] = {}
        for c in s["checks"]:
            judged.setdefault(c["run"], []).append(c["name"])
        plan = plan_scenario(load_scenario(suite / f"{name}.toml")).checks()
        assert {k: sorted(v) for k, v in judged.items()} == {k: sorted(v) for k, v in plan.items()}


@pytest.mark.ranks
def test_the_fixture_runs_a_scenario_given_as_a_dict_and_returns_its_result(tmp_path: Path) -> None:
    (tmp_path / "test_mine.py").write_text('''
def test_two_ranks_match_one(mlx_ddp):
    result = mlx_ddp({
        "scenario": {"name": "mine", "description": "two ranks match one", "seed": 3},
        "model": {"arch": "qwen3"},
        "data": {"rows": 16, "max_chars": 60},
        "train": {"steps": 3, "global_batch": 4},
        "checks": {"reference": "single"},
        "runs": [{"name": "single", "world_size": 1}, {"name": "ddp2", "world_size": 2}],
    })
    assert result.passed, result.table
    assert result.check("loss_parity", "ddp2").passed
    assert len(result.runs["ddp2"].losses) == 3 and result.runs["ddp2"].world_size == 2
    assert result.runs["ddp2"].losses[-1] < result.runs["ddp2"].losses[0] + 1.0
    assert all(b > 0 for b in result.runs["ddp2"].mlx_peak_bytes)
    assert (result.artifacts / "result.json").is_file()
''')
    p = _pytest(tmp_path, "test_mine.py", "-q", "--mlx-ddp-progress", "0.2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 passed" in p.stdout
    # progress while it ran, as lines of pytest's own reporter (captured output is not where they go)
    assert re.search(r"^\[mlx-ddp\] progress mine/ddp2 \(2 ranks\): step [1-3]/3 \[r0 \S+, r1 \S+\]", p.stdout,
                     re.MULTILINE), p.stdout


@pytest.mark.ranks
def test_under_xdist_a_scenarios_tests_stay_on_one_worker(tmp_path: Path) -> None:
    for name in ("first", "second"):
        _default(write_scenario(tmp_path, name, (1, 2), steps=2))
    (tmp_path / "test_plain.py").write_text("".join(f"def test_{i}():\n    pass\n" for i in range(6)))
    p = _pytest(tmp_path, ".", "-n", "2", "-v")
    assert p.returncode == 0, p.stdout + p.stderr
    workers: dict[str, set[str]] = {}
    for m in re.finditer(r"\[(gw\d+)\] \[\s*\d+%\] PASSED (\S+?)::", p.stdout):
        workers.setdefault(m.group(2), set()).add(m.group(1))
    assert workers["first.toml"] and workers["second.toml"], p.stdout
    assert len(workers["first.toml"]) == 1 and len(workers["second.toml"]) == 1


@pytest.mark.ranks
def test_a_runs_steps_are_a_pytest_benchmark_that_saves_and_compares(tmp_path: Path) -> None:
    _default(write_scenario(tmp_path, "speed", (1, 2), steps=5))
    storage = f"--benchmark-storage=file://{tmp_path / 'storage'}"
    first = _pytest(tmp_path, "speed.toml", "--mlx-ddp-benchmark", "-k", "throughput", storage,
                    "--benchmark-save=base", f"--benchmark-json={tmp_path / 'bench.json'}")
    assert first.returncode == 0, first.stdout + first.stderr
    benches = {b["name"]: b for b in json.loads((tmp_path / "bench.json").read_text())["benchmarks"]}
    assert set(benches) == {"throughput[speed-single]", "throughput[speed-ddp2]"}
    ddp2 = benches["throughput[speed-ddp2]"]
    assert ddp2["stats"]["rounds"] == 4 and ddp2["stats"]["median"] > 0  # steps 2-5, seconds per step
    assert ddp2["extra_info"]["world_size"] == 2 and ddp2["extra_info"]["median_tok_s"] > 0
    assert ddp2["extra_info"]["device"] and ddp2["extra_info"]["backend"] == "ring"

    again = _pytest(tmp_path, "speed.toml", "--mlx-ddp-benchmark", "-k", "throughput", storage,
                    "--benchmark-compare=0001", "--benchmark-compare-fail=median:1000%")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "0001_base" in again.stdout and "throughput[speed-ddp2] (NOW)" in again.stdout


def test_a_test_marked_with_its_world_size_holds_its_slots_and_its_launches_use_them(tmp_path: Path) -> None:
    """Budget 2: the marked test holds both slots (another process finds none free), and a
    2-rank launch inside it proceeds at once instead of waiting for its own test."""
    slots = tmp_path / "slots"
    (tmp_path / "test_marked.py").write_text(f'''
import subprocess, sys, time
import pytest
from harness.controller import rank_budget

PROBE = ("from pathlib import Path; from harness.controller.rank_budget import _try_take; "
         "print(len(_try_take(Path({str(slots)!r}), 1, 2, 'a probe')[0]))")


@pytest.mark.mlx_ddp_world_size(2)
def test_holds_and_launches():
    other = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    assert other.strip() == "0"  # no slot free for anyone else
    t0 = time.monotonic()
    mine = rank_budget.hold(2, "a launch inside the test")
    assert time.monotonic() - t0 < 1 and mine.held == []  # the test's own slots


def test_unmarked_tests_hold_nothing():
    other = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    assert other.strip() == "1"
    assert rank_budget.held_here() == 0


@pytest.mark.mlx_ddp_world_size(0)
def test_bad_size():
    pass
''')
    p = _pytest(tmp_path, "test_marked.py", "-q",
                env={"MLX_DDP_HARNESS_RANK_BUDGET": "2", "MLX_DDP_HARNESS_RANK_DIR": str(slots)})
    assert "2 passed" in p.stdout and "1 error" in p.stdout, p.stdout + p.stderr
    assert "takes a world size of at least 1, got 0" in p.stdout


def test_the_closing_block_counts_scenario_tests_only() -> None:
    from types import SimpleNamespace

    from harness.present.pytest_support import summary_lines

    def rep(nodeid: str, when: str = "call", **props: float) -> SimpleNamespace:
        return SimpleNamespace(nodeid=nodeid, when=when, user_properties=list(props.items()))

    stats = {"passed": [rep("s/a.toml::ddp2::loss_parity"), rep("s/a.toml::ddp2::launch", "setup"),
                        rep("tests/test_x.py::test_one")],
             "failed": [rep("s/b.toml::ddp2::param_parity")], "error": [rep("s/c.toml::ddp2::launch", "setup")],
             "xfailed": [rep("s/b.toml::ddp2::loss_parity")], "skipped": [rep("s/d.toml::not_in_default_set", "setup")]}
    assert summary_lines(stats, "out") == [
        "4 scenarios: 1 passed, 2 failed, 1 skipped; tests: 1 passed, 1 expected failures shown, 1 skipped, 1 FAILED, "
        "1 errors",
        "artifacts: out"]
    assert summary_lines({"passed": [rep("tests/test_x.py::test_one")]}, None) == []
    waited = {"passed": [rep("s/a.toml::single::launch", queued_s=0.2), rep("s/a.toml::ddp2::launch", queued_s=11.04),
                         rep("s/b.toml::ddp4::launch", queued_s=3.0)]}
    assert summary_lines(waited, "out")[1] == ("rank slots: 2 runs waited 14.0 s in all before starting (the longest: "
                                               "s/a.toml::ddp2, 11.0 s)")
