"""``examples/ddp_train.py`` with its session's calls timed (``observer_effect.py`` runs it bare and
under the harness alike): at each ``run.step`` it notes the time, the seconds spent so far inside
``run.probe`` and ``run.step``, and in the garbage collector (``gc.callbacks``) with its count of
full (generation 2) collections; at ``run.finish`` it writes those rows and the objects the
collector tracked at the first step to a JSON file in the directory ``TIMES_VAR`` names
(``bare-PID.json`` or ``harness-PID.json``). Two clock reads per call and per collection: the same
on both sides."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

TIMES_VAR = "OBSERVER_EFFECT_TIMES"
SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "ddp_train.py"


class TimedSession:
    """The session, its ``probe`` and ``step`` timed; everything else passed through."""

    def __init__(self, session: Any):
        self.session = session
        self.marks: list[list[float]] = []
        self.in_probe = self.in_step = self.in_gc = 0.0
        self.full_collections, self.objects = 0, 0
        self._gc_began = 0.0
        gc.callbacks.append(self._collecting)

    def _collecting(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
            return
        self.in_gc += time.perf_counter() - self._gc_began
        self.full_collections += info["generation"] == 2

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def probe(self, *args: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        self.session.probe(*args, **kwargs)
        self.in_probe += time.perf_counter() - t

    def step(self, *args: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        self.marks.append([t, self.in_probe, self.in_step, self.in_gc, self.full_collections])
        if len(self.marks) == 1:
            self.objects = len(gc.get_objects())
        self.session.step(*args, **kwargs)
        self.in_step += time.perf_counter() - t

    def finish(self, params: Any) -> None:
        if os.environ.get(TIMES_VAR):
            side = "bare" if type(self.session).__name__ == "BareSession" else "harness"
            (Path(os.environ[TIMES_VAR]) / f"{side}-{os.getpid()}.json").write_text(
                json.dumps({"rows": self.marks, "objects": self.objects}))
        self.session.finish(params)


class TimedApi:
    """What the script sees as ``harness.api``: its session, timed."""

    def __init__(self, api: Any):
        self.api = api

    def session(self) -> TimedSession:
        return TimedSession(self.api.session())


def main() -> None:
    spec = importlib.util.spec_from_file_location("ddp_train", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.api = TimedApi(script.api)
    script.main()


def split(written: dict[str, Any], first: int) -> list[float]:
    """Per step from step ``first`` to the last: the script's own seconds, the seconds inside the
    session's calls, the seconds in the garbage collector (inside either), the full collections;
    the objects the collector tracked at the first step; the median of the script's own seconds."""
    rows = written["rows"]
    a, b = rows[first - 1], rows[-1]
    n = len(rows) - first
    calls = (b[1] - a[1] + b[2] - a[2]) / n
    own = [(y[0] - x[0]) - (y[1] - x[1] + y[2] - x[2]) for x, y in zip(rows[first - 1:-1], rows[first:], strict=True)]
    return [(b[0] - a[0]) / n - calls, calls, (b[3] - a[3]) / n, (b[4] - a[4]) / n, written["objects"],
            statistics.median(own)]


if __name__ == "__main__":
    main()
