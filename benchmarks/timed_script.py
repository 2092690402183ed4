"""``examples/ddp_train.py`` with its session's calls timed (``observer_effect.py`` runs it bare and
under the harness alike): at each ``run.step`` it notes the time and the seconds spent so far inside
``run.probe`` and ``run.step``, and at ``run.finish`` writes those rows to a JSON file in the
directory ``TIMES_VAR`` names (``bare-PID.json`` or ``harness-PID.json``). Two clock reads per call:
the same on both sides."""

from __future__ import annotations

import importlib.util
import json
import os
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
        self.in_probe = self.in_step = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def probe(self, *args: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        self.session.probe(*args, **kwargs)
        self.in_probe += time.perf_counter() - t

    def step(self, *args: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        self.marks.append([t, self.in_probe, self.in_step])
        self.session.step(*args, **kwargs)
        self.in_step += time.perf_counter() - t

    def finish(self, params: Any) -> None:
        if os.environ.get(TIMES_VAR):
            side = "bare" if type(self.session).__name__ == "BareSession" else "harness"
            (Path(os.environ[TIMES_VAR]) / f"{side}-{os.getpid()}.json").write_text(json.dumps(self.marks))
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


def split(rows: list[list[float]], first: int) -> tuple[float, float]:
    """Seconds per step from step ``first`` to the last: the script's own, and inside the session's calls."""
    a, b = rows[first - 1], rows[-1]
    n = len(rows) - first
    calls = (b[1] - a[1] + b[2] - a[2]) / n
    return (b[0] - a[0]) / n - calls, calls


if __name__ == "__main__":
    main()
