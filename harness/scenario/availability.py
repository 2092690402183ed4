"""Which runs of a scenario this machine can run: a run whose trainer needs an optional package
that is not installed (``TrainerInfo.requires``) is skipped, saying so, and the rest of the
scenario runs. A scenario left without its reference run, or with a run whose comparison or
resume source was skipped, is skipped whole."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

from harness.scenario.spec import Scenario


def missing(kind: str) -> str | None:
    """Why trainer ``kind`` cannot run here (its optional package is not installed), or None."""
    from harness.scenario.trainers import trainers

    info = trainers().get(kind)
    if info is None or info.requires is None or importlib.util.find_spec(info.requires) is not None:
        return None
    return f"{info.requires.replace('_', '-')} is not installed (install it with: {info.install})"


@dataclass(frozen=True)
class Skipped:
    """Runs of ``scenario`` left out (all of them when ``whole``), and why."""

    scenario: str
    runs: tuple[str, ...]
    reason: str
    whole: bool

    def line(self) -> str:
        what = self.scenario if self.whole else f"{self.scenario}: runs {', '.join(self.runs)}"
        return f"skipped {what}: {self.reason}"

    def to_json(self) -> dict[str, object]:
        return {"scenario": self.scenario, "runs": list(self.runs), "reason": self.reason, "whole": self.whole}


def runnable(s: Scenario) -> tuple[Scenario | None, Skipped | None]:
    """``s`` without the runs this machine cannot run (None when nothing meaningful is left),
    and what was skipped."""
    reasons = {r.name: why for r in s.runs if (why := missing(s.for_run(r).trainer.kind))}
    if not reasons:
        return s, None
    reason = "; ".join(sorted(set(reasons.values())))
    kept = [r for r in s.runs if r.name not in reasons]
    needed = {s.checks.reference} | {n for r in kept for n in (r.compare_to, r.resume_from) if n}
    if not kept or needed & reasons.keys():
        return None, Skipped(s.name, tuple(r.name for r in s.runs), reason, True)
    return dataclasses.replace(s, runs=kept), Skipped(s.name, tuple(reasons), reason, False)
