"""One record per check family (``harness.scenario.checks``): a check's name is written once in
harness/, every family's judge resolves, its doc line is in docs/checks.md, and adding a check is
one record plus its judge function: a toy family, declared by an entry point of a package
written here (as another project would ship it), appears with real ranks in the CLI's table, in
result.json and in the pytest plugin's JUnit XML."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from harness.judge.checks import Check
from harness.judge.verdict import judge_of
from harness.scenario import ScenarioError, load_scenario
from harness.scenario import checks as registry
from harness.scenario.checks import CheckFamily, CheckName, check_names, families
from harness.scenario.plan import plan_scenario
from harness.scenario.spec import RunSpec, Scenario
from tests.conftest import REPO, cli, write_scenario
from tests.test_structure import string_literals

if TYPE_CHECKING:
    from harness.judge.families import Judged

# Where a check's name is written as a string because it also names another thing.
OTHER_MEANINGS = {
    "resume_step": {"harness/scenario/rules.py"},  # the [[runs]] key resume_step
    "lr_schedule": {"harness/trainers/reference/resume.py"},  # the [train] key lr_schedule
    "global_rng_untouched": {"harness/rank/reporter.py", "harness/judge/checks.py"},  # a rank result's field
    "compile_scope": {"harness/trainers/unsloth_zoo/rank.py"},  # a key of unsloth-zoo's own result
}


def test_no_check_name_is_written_as_a_string_in_harness() -> None:
    literals = string_literals(REPO / "harness")
    written = {name: [p for p in literals.get(name, []) if p.split(":")[0] not in OTHER_MEANINGS.get(name, set())]
               for name in check_names()}
    assert {name: places for name, places in written.items() if places} == {}
    assert len(set(check_names())) == len(check_names())


def test_a_check_named_by_its_member_is_written_as_a_plain_string() -> None:
    c = Check(CheckName.loss_parity, "ddp2", True, 1e-6, 1e-5)
    assert type(c.name) is str and type(c.to_dict()["name"]) is str
    assert json.dumps(c.to_dict()) == json.dumps(Check("loss_parity", "ddp2", True, 1e-6, 1e-5).to_dict())
    plan = plan_scenario(load_scenario(REPO / "examples" / "minimal_parity.toml")).checks()
    assert all(type(n) is str for names in plan.values() for n in names)


def test_every_familys_judge_resolves_and_a_bad_one_is_named() -> None:
    for family in families():
        assert callable(judge_of(family)), family.name
    bad = CheckFamily("nowhere", ("nowhere_check",), lambda s, spec: [], "harness.judge.families:missing", "doc")
    with pytest.raises(ValueError, match="check family nowhere: its judge harness.judge.families:missing"):
        judge_of(bad)
    with pytest.raises(ValueError, match="not 'module:function'"):
        CheckFamily("bad", ("bad_check",), lambda s, spec: [], "no_colon", "doc")


def test_every_familys_doc_line_is_in_docs_checks_md() -> None:
    text = " ".join((REPO / "docs" / "checks.md").read_text().split())
    missing = [f.name for f in families() if " ".join(f.doc.split()) not in text]
    assert missing == []


# The walkthrough "add a check": the record, and its judge function.
TOY_CHECK = "toy_steps_positive"


def applies_toy(s: Scenario, spec: RunSpec) -> list[str]:
    return [TOY_CHECK]


def judge_toy(j: Judged) -> list[Check]:
    steps = int(j.run.result()["steps"] or 0)
    return [Check(TOY_CHECK, j.run.name, steps > 0, steps, None, f"trained {steps} steps (at least 1 needed)")]


TOY = CheckFamily("toy", (TOY_CHECK,), applies_toy, "tests.test_check_families:judge_toy",
                  "A run trained at least one step (the toy family of tests/test_check_families.py).")


@pytest.fixture
def toy_family(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The toy family registered in this process, and declared under the ``mlx_ddp_harness.checks``
    entry points by a package on the PYTHONPATH of every process started with the returned
    variables; unregistered at teardown."""
    site = tmp_path / "site"
    info = site / "toy_checks-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-checks\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINTS}]\ntoy = tests.test_check_families:TOY\n")
    registry.register(TOY)
    try:
        yield {"PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])}
    finally:
        registry.unregister(TOY.name)
    assert TOY_CHECK not in check_names()


def _toy_scenario(d: Path, extra: str = "") -> Path:
    d.mkdir(exist_ok=True)
    return write_scenario(d, "toy_checks", (1, 2), steps=3, checks=extra)


def test_a_registered_family_is_planned_judged_before_mutations_and_may_be_marked(
        toy_family: dict[str, str], tmp_path: Path) -> None:
    assert registry.families()[-1].name == "mutation" and registry.families()[-2] is TOY
    marked = _toy_scenario(tmp_path / "suite", f'[checks.expected_failures]\n{TOY_CHECK} = "a toy reason"')
    plan = plan_scenario(load_scenario(marked)).checks()
    assert all(names[-1] == TOY_CHECK for names in plan.values()), plan
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(TOY)
    registry.unregister(TOY.name)
    with pytest.raises(ScenarioError, match=f"expected_failures.{TOY_CHECK}: unknown check"):
        load_scenario(marked)
    registry.register(TOY)


@pytest.mark.ranks
def test_a_toy_family_added_by_an_entry_point_shows_in_the_table_result_json_and_junit(
        toy_family: dict[str, str], tmp_path: Path) -> None:
    path = _toy_scenario(tmp_path / "suite")
    out = tmp_path / "out"
    p = cli("run", str(path), "--out", str(out), env=toy_family)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [line.split() for line in p.stdout.splitlines() if line.split()[:1] == [TOY_CHECK]]
    assert sorted(row[1] for row in rows) == ["ddp2", "single"] and all("pass" in row for row in rows), p.stdout

    (s,) = json.loads((out / "result.json").read_text())["scenarios"]
    for run in ("single", "ddp2"):
        mine = [c for c in s["checks"] if c["run"] == run]
        assert mine[-1]["name"] == TOY_CHECK and mine[-1]["passed"] and mine[-1]["value"] == 3, mine[-1]

    junit = tmp_path / "junit.xml"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, **toy_family}
    plugin = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "suite/toy_checks.toml", "-q",
                             f"--junitxml={junit}"], capture_output=True, text=True, cwd=tmp_path, timeout=600, env=env)
    assert plugin.returncode == 0, plugin.stdout + plugin.stderr
    cases = {f"{c.get('classname')}::{c.get('name')}": c for c in ET.parse(junit).getroot().iter("testcase")}
    for run in ("single", "ddp2"):
        case = cases[f"suite.toy_checks.toml.{run}::{TOY_CHECK}"]
        assert case.find("failure") is None and case.find("skipped") is None
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        assert props["result"] == "pass" and props["value"] == "3", props
