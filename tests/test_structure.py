"""The tree shows its design: a scenario's walk from ``run_scenario_file`` to its report goes
forward (``tests/walk.py``), modules stay small, and a check's name and a trainer's kind are each
written once in ``harness/`` (docs/development.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests import walk
from tests.conftest import REPO

WALK_DEPTH = 4  # calls this deep from run_scenario_file: its stages, theirs, and what those call
MAX_CLIMBS, MAX_RETURNS, MAX_LINES = 5, 10, 400


@pytest.mark.ranks
def test_a_scenarios_walk_goes_forward(tmp_path: Path) -> None:
    w = walk.walk_of(REPO / "examples" / "minimal_parity.toml", tmp_path, WALK_DEPTH)
    assert w.climbs <= MAX_CLIMBS and w.returns <= MAX_RETURNS, w.line() + "\n" + "\n".join(w.climbed)
    assert w.stays[0] == "harness.present.scenario_result" and "harness.scenario.plan" in w.stays


def test_the_walk_counts_climbs_and_returns() -> None:
    """The figures of a made-up walk: present -> pipeline -> plan -> pipeline -> judge -> present."""
    w = walk.measure(["harness.present.scenario_result", "harness.present.pipeline", "harness.scenario.plan",
                      "harness.scenario.plan", "harness.present.pipeline", "harness.judge.verdict",
                      "harness.present.scenario_result"])
    assert w.stays == ["harness.present.scenario_result", "harness.present.pipeline", "harness.scenario.plan",
                       "harness.present.pipeline", "harness.judge.verdict", "harness.present.scenario_result"]
    assert w.returns == 2
    assert w.climbed == ["harness.scenario.plan -> harness.present.pipeline",
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
