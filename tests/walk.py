"""A scenario's walk through the harness's modules, as ``run_scenario_file`` takes it in the
controller's process: every harness function in the order it is first called, its module a
*room*; consecutive calls in one room are one *stay*. A step into a room that imports (directly
or not) the room it comes from *climbs back up*; a step into a room visited before *returns*.

``python -m tests.walk FILE`` prints the figures and the walk; ``tests/test_structure.py``
holds them to the limits of docs/development.md.
"""

from __future__ import annotations

import ast
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def import_graph() -> dict[str, set[str]]:
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


def _below(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Module -> every module it imports, directly or not."""
    out: dict[str, set[str]] = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        out[start] = seen
    return out


@dataclass
class Walk:
    stays: list[str]
    climbs: int
    returns: int
    climbed: list[str]

    @property
    def rooms(self) -> int:
        return len(set(self.stays))

    def line(self) -> str:
        return (f"{self.rooms} rooms in {len(self.stays)} stays, climbs back up {self.climbs} times, "
                f"returns {self.returns} times")


def measure(modules: list[str]) -> Walk:
    """The walk of a sequence of first calls' modules."""
    below = _below(import_graph())
    stays = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
    climbed = [f"{a} -> {b}" for a, b in zip(stays, stays[1:], strict=False) if a in below.get(b, ())]
    returns = sum(1 for i, m in enumerate(stays) if m in stays[:i])
    return Walk(stays, len(climbed), returns, climbed)


def _harness(frame) -> bool:  # noqa: ANN001
    """A frame of a function written in a harness module (not one a dataclass generated)."""
    code = frame.f_code
    return (frame.f_globals.get("__name__", "").startswith("harness") and not code.co_name.startswith("<")
            and code.co_filename.startswith(str(REPO / "harness")))


def _door(frame) -> bool:  # noqa: ANN001
    """A module-level function: a room's door (a method or property belongs to the object it reads)."""
    return frame.f_globals.get(frame.f_code.co_name) is not None and "." not in frame.f_code.co_qualname


def _first_calls(order: list[str], depth: int):  # noqa: ANN202 - a sys.setprofile function
    """A profile function appending to ``order`` the module of each harness function called at
    most ``depth`` harness calls deep, at its first such call."""
    seen: set[object] = set()

    def profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        if event != "call" or frame.f_code in seen or not _harness(frame) or not _door(frame):
            return
        d, f = 0, frame
        while f is not None and d <= depth:
            if f.f_code.co_name == "<module>" and f.f_globals.get("__name__", "").startswith("harness"):
                return  # a module being imported: not a step of the walk
            d += _harness(f)
            f = f.f_back
        if d > depth:
            return
        seen.add(frame.f_code)
        order.append(frame.f_globals["__name__"])

    return profile


def first_calls(fn, *args, depth: int = 99, **kwargs) -> tuple[list[str], object]:
    """The modules of the harness functions ``fn(*args, **kwargs)`` calls at most ``depth``
    harness calls deep, each function at its first such call, in order; and what ``fn`` returned."""
    order: list[str] = []
    sys.setprofile(_first_calls(order, depth))
    try:
        out = fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return order, out


PLANNING = ("harness.scenario.runs", "harness.scenario.checks", "harness.scenario.trainers", "harness.scenario.plan")


def _replanning(calls: dict[str, int]):  # noqa: ANN202 - a sys.setprofile function
    """A profile function counting in ``calls`` the planning rooms' functions (``PLANNING``)
    called once the first run is launched."""
    launched = {"yes": False}

    def profile(frame, event, arg):  # noqa: ANN001
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if name == "harness.controller.scenario_runs" and frame.f_code.co_name == "run_plan":
            launched["yes"] = True
        if launched["yes"] and name in PLANNING and _harness(frame) and _door(frame):
            key = f"{name}.{frame.f_code.co_name}"
            calls[key] = calls.get(key, 0) + 1

    return profile


def observe(scenario: Path, out: Path, depth: int = 99) -> tuple[Walk, dict[str, int]]:
    """One run of ``scenario`` (``run_scenario_file``, outputs in ``out``) watched two ways: its
    walk (calls at most ``depth`` deep) and what a later stage works out again instead of reading
    the plan: calls of the planning rooms' functions once the first run is launched, by function."""
    from harness.present.scenario_result import run_scenario_file
    from harness.scenario import load_scenario

    loaded = load_scenario(scenario)
    order: list[str] = []
    calls: dict[str, int] = {}
    walking, replanning = _first_calls(order, depth), _replanning(calls)

    def profile(frame, event, arg):  # noqa: ANN001
        walking(frame, event, arg)
        replanning(frame, event, arg)

    sys.setprofile(profile)
    try:
        run_scenario_file(loaded, out)
    finally:
        sys.setprofile(None)
    return measure(order), calls


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        w, again = observe(Path(sys.argv[1]), Path(tmp), int(sys.argv[2]) if len(sys.argv) > 2 else 99)
    print(w.line())
    print(" -> ".join(w.stays))
    print("climbs back up:", "; ".join(w.climbed))
    print(f"planning functions called after the first launch: {sum(again.values())}", again)
