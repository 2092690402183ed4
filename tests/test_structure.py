"""The tree shows its design: a scenario's walk from ``run_scenario_file`` to its report goes
forward (``tests/walk.py``), modules stay small, and a check's name and a trainer's kind are each
written once in ``harness/`` (docs/development.md)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from tests import walk
from tests.conftest import REPO

WALK_DEPTH = 4  # calls this deep from run_scenario_file: its stages, theirs, and what those call
MAX_CLIMBS, MAX_RETURNS, MAX_LINES = 5, 10, 400


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> tuple[walk.Walk, dict[str, int]]:
    """One run of ``examples/minimal_parity.toml`` watched for both tests below."""
    return walk.observe(REPO / "examples" / "minimal_parity.toml", tmp_path_factory.mktemp("walk"), WALK_DEPTH)


@pytest.mark.ranks
def test_a_scenarios_walk_goes_forward(observed: tuple[walk.Walk, dict[str, int]]) -> None:
    w = observed[0]
    assert w.climbs <= MAX_CLIMBS and w.returns <= MAX_RETURNS, w.line() + "\n" + "\n".join(w.climbed)
    assert w.stays[0] == "harness.present.scenario_result" and "harness.scenario.plan" in w.stays


@pytest.mark.ranks
def test_no_stage_after_the_plan_works_the_scenario_out_again(observed: tuple[walk.Walk, dict[str, int]]) -> None:
    """Once runs launch, the planning rooms are read through the plan, not called: what is left is
    the check families' registry the verdict iterates (a run's trainer record is the plan's)."""
    again = observed[1]
    allowed = {"harness.scenario.checks.families", "harness.scenario.checks._load"}
    assert set(again) <= allowed and sum(again.values()) <= 10, again


def test_the_walk_counts_climbs_and_returns() -> None:
    """The figures of a made-up walk: present -> pipeline -> plan -> pipeline -> judge -> present."""
    w = walk.measure(["harness.present.scenario_result", "harness.run.pipeline", "harness.scenario.plan",
                      "harness.scenario.plan", "harness.run.pipeline", "harness.judge.verdict",
                      "harness.present.scenario_result"])
    assert w.stays == ["harness.present.scenario_result", "harness.run.pipeline", "harness.scenario.plan",
                       "harness.run.pipeline", "harness.judge.verdict", "harness.present.scenario_result"]
    assert w.returns == 2
    assert w.climbed == ["harness.scenario.plan -> harness.run.pipeline",
                         "harness.judge.verdict -> harness.present.scenario_result"]  # each room imports the one before


def test_no_module_is_over_400_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in (REPO / "harness").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def string_literals(root: Path) -> dict[str, list[str]]:
    """Every string constant in ``root``'s modules outside docstrings -> where it is written."""
    found: dict[str, list[str]] = {}
    for p in root.rglob("*.py"):
        tree = ast.parse(p.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
                found.setdefault(n.value, []).append(f"{p.relative_to(REPO)}:{n.lineno}")
    return found


# The same strings written with another meaning than a trainer kind, by file: the summary's key
# naming the reference run, the Python packages MLX's architectures come from, TrainerInfo's flag
# fields (``with_kind("script")``) and argparse's destination of the sub-command.
OTHER_MEANINGS = {
    "reference": {"harness/present/plots.py", "harness/present/tables.py", "harness/run/results.py"},
    "mlx_lm": {"harness/rank/models.py"},
    "mlx_vlm": {"harness/rank/weights.py", "harness/rank/vision.py", "harness/trainers/reference/rank.py"},
    "script": {"harness/present/starter.py"},
    "command": {"harness/present/starter.py", "harness/present/cli.py"},
}


def test_a_trainer_kind_is_written_in_its_record_alone() -> None:
    """Each built-in kind is written in its own record (and ``reference`` as the default of
    ``[trainer] kind``); everything else reads the records."""
    from harness.scenario.trainers import BUILTIN, trainers

    literals = string_literals(REPO / "harness")
    for module in BUILTIN:
        kind = importlib.import_module(module).TRAINER.kind
        record = str(Path(*module.split(".")) / "__init__.py")
        places = {p.split(":")[0] for p in literals.get(kind, [])}
        assert record in places, f"{kind} is not written in its record {record}"
        allowed = {record} | OTHER_MEANINGS.get(kind, set()) | ({"harness/scenario/spec.py"} if kind == "reference"
                                                                 else set())
        assert places <= allowed, f"{kind} is written outside its record: {sorted(places - allowed)}"
    assert set(trainers()) >= {importlib.import_module(m).TRAINER.kind for m in BUILTIN}
