"""The code stays ruff-clean, and its modules import one way: no import circles."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def test_ruff_clean() -> None:
    ruff = Path(sys.executable).parent / "ruff"
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed (it is in the test extra)")
    p = subprocess.run([exe, "check", "harness", "tests", "benchmarks", "examples"], cwd=REPO, capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def _import_graph() -> dict[str, set[str]]:
    """Module -> the harness modules it imports, at the top or inside a function."""
    files = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (REPO / "harness").rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for m, p in files.items():
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[m] |= {n for n in names if n in files and n != m and not m.startswith(n + ".")}
    return graph


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


def test_the_scenario_layer_imports_no_upper_layer() -> None:
    graph = _import_graph()
    for low in ("harness.scenario_spec", "harness.scenario_rules", "harness.scenario", "harness.schema"):
        upper = {m for m in graph[low] if m.split(".")[1] in ("controller", "judge", "present", "rank", "trainers")}
        assert not upper, f"{low} imports {sorted(upper)}"


def test_mutation_names_are_the_mutations() -> None:
    from harness.scenario_spec import MUTATION_NAMES
    from harness.trainers.reference.semantics import MUTATIONS

    assert set(MUTATION_NAMES) == set(MUTATIONS)
