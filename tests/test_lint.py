"""The code stays ruff-clean, and its modules import one way: no import circles."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.walk import import_graph as _import_graph


def test_ruff_clean() -> None:
    ruff = Path(sys.executable).parent / "ruff"
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed (it is in the test extra)")
    p = subprocess.run([exe, "check", "harness", "tests", "benchmarks", "examples"], cwd=REPO, capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_no_import_circles() -> None:
    graph = _import_graph()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo += graph[m]
        return False

    circles = sorted(f"{a} -> {b} -> ... -> {a}" for a in graph for b in graph[a] if reaches(b, a))
    assert not circles, "\n".join(circles)


# The rooms and their levels: a module imports only its own room, rooms below it on its own side
# of the process boundary, and the base below both sides (the protocol, the scenario, the run
# plan, the trainer records, the inputs both sides read, memory). ``harness.__main__`` is the entry.
RANK_SIDE = {"rank": 1, "trainers": 2, "api": 3}  # harness.api: what a user's script imports, above all
CONTROLLER_SIDE = {"controller": 1, "judge": 2, "run": 3, "present": 4}


def _records() -> set[str]:
    """The trainer record modules: ``harness.trainers`` and each trainer package's ``__init__``
    (``harness.trainers.<kind>``, its ``TRAINER``), which the registry imports by name."""
    inits = (REPO / "harness" / "trainers").glob("*/__init__.py")
    return {"harness.trainers", *(f"harness.trainers.{p.parent.name}" for p in inits)}


def _room(module: str) -> tuple[str, int]:
    part = module.split(".")[1] if module.count(".") else ""
    if module in _records():
        return "base", 0  # a record: read by both sides
    if part in RANK_SIDE:
        return "rank side", RANK_SIDE[part]
    if part in CONTROLLER_SIDE:
        return "controller side", CONTROLLER_SIDE[part]
    return "base", 0


def test_rooms_import_only_their_own_side_and_below() -> None:
    wrong = []
    for m, imported in _import_graph().items():
        if m == "harness.__main__":
            continue
        side, level = _room(m)
        for n in imported:
            n_side, n_level = _room(n)
            if n_side != "base" and (n_side != side or n_level > level):
                wrong.append(f"{m} ({side}) -> {n} ({n_side})")
    assert not wrong, "\n".join(sorted(wrong))


def test_trainer_records_import_only_base_modules() -> None:
    """A trainer's record is read on both sides of the process boundary: its module imports, at
    its top, only the standard library and base modules (no rank side, no trainer's rank code, no
    MLX), and loading every record loads nothing else of the harness."""
    records = _records()
    assert {"harness.trainers.reference", "harness.trainers.mlx_lm"} <= records, records
    wrong = []
    for m in sorted(records):
        path = REPO / Path(*m.split(".")) / "__init__.py"
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for n in names:
                top = n.split(".")[0]
                if top == "harness" and (_room(n) != ("base", 0) or n.startswith("harness.trainers.")):
                    wrong.append(f"{m} -> {n}")
                elif top not in ("harness", "__future__") and top not in sys.stdlib_module_names:
                    wrong.append(f"{m} -> {n} (not the standard library)")
    assert not wrong, "\n".join(wrong)
    code = ("import sys; from harness.scenario.trainers import trainers; trainers(); "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('harness', 'mlx', 'numpy'))))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    beyond = [m for m in loaded.stdout.split() if _room(m) != ("base", 0) or m.startswith(("mlx", "numpy"))
              or (m.startswith("harness.trainers.") and m not in records)]
    assert not beyond, beyond


def test_mutation_names_are_the_mutations() -> None:
    from harness.scenario.names import COLLECTIVE_MUTATIONS, DATA_MUTATIONS, MUTATION_NAMES, REFERENCE_MUTATIONS
    from harness.trainers.reference.semantics import MUTATIONS

    assert set(REFERENCE_MUTATIONS) == set(MUTATIONS)
    assert set(MUTATION_NAMES) == set(MUTATIONS) | set(COLLECTIVE_MUTATIONS) | set(DATA_MUTATIONS)
