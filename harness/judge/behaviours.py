"""Expected failures: known behaviours of a trainer or model, each with the checks that show it.

``[checks.expected_failures]`` holds two forms. A behaviour::

    [checks.expected_failures.mean_of_means]
    reason = "mlx-lm's loss is the mean of the ranks' mean losses"
    runs = ["ddp2"]                                    # optional: every judged run
    checks = { step_grad_parity = 5.7e-3, param_parity = 0.155 }

names the checks that show it with the deviation each measured (in the check's own units, as
its Value column shows it). And the short form, ``check = "reason"`` (or ``check = { run =
"reason" }``), is a behaviour of that one check with no measured deviation.

A behaviour is *shown* in a run when any of its checks fails there: all its checks then read
"xfail" (a check that passed names the one that showed it); a check that failed without
measuring anything (a missing probe or figure) shows nothing and stays a failure. It is *gone* ("XPASS", which fails
the scenario until the marker is removed) only when every one of its checks passed and at least
one of them had the power to see its recorded deviation (its limit below it); a check of the
short form has no recorded deviation and counts as having power. Otherwise the checks passed
without power to see what the marker recorded (a coarser device or precision): the behaviour
is *inconclusive*, which does not fail the scenario and is reported with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.scenario.spec import is_behaviour_table


@dataclass(frozen=True)
class Behaviour:
    """A known behaviour: ``checks`` maps each check that shows it to the deviation it measured
    (``None``: not recorded); ``runs``: the runs it is expected in (``None``: every run)."""

    name: str
    reason: str
    checks: dict[str, float | None]
    runs: tuple[str, ...] | None = None

    def covers(self, check: str, run: str) -> bool:
        return check in self.checks and (self.runs is None or run in self.runs)


def behaviours(expected: dict[str, Any]) -> list[Behaviour]:
    """Every behaviour of a scenario's ``[checks.expected_failures]`` (validated when loaded)."""
    out = []
    for key, value in expected.items():
        if is_behaviour_table(value):
            runs = tuple(value["runs"]) if value.get("runs") is not None else None
            out.append(Behaviour(key, value["reason"], dict(value["checks"]), runs))
        elif isinstance(value, dict):
            out += [Behaviour(key, why, {key: None}, (run,)) for run, why in value.items()]
        else:
            out.append(Behaviour(key, value, {key: None}))
    return out


def reason_for(expected: dict[str, Any], check: str, run: str) -> str | None:
    """Why ``check`` is expected to fail in ``run`` (None: it is not)."""
    for b in behaviours(expected):
        if b.covers(check, run):
            return b.reason
    return None


def mark_expected_failures(checks: list[Any], expected: dict[str, Any]) -> None:
    """Give every check a behaviour covers its outcome (the module docstring): ``xfail`` holds the
    reason, ``expected_state`` "shown", "gone" or "inconclusive"."""
    measured = {id(c): c.passed for c in checks}  # before any behaviour marks them
    for b in behaviours(expected):
        runs = sorted({c.run for c in checks if b.covers(c.name, c.run) and c.applicable})
        for run in runs:  # a check claimed by an earlier behaviour stays with it
            mine = [c for c in checks if c.run == run and b.covers(c.name, c.run) and c.applicable and c.xfail is None
                    and not getattr(c, "no_power", False)]  # a check without power shows nothing: it stays failed
            _judge(b, mine, measured)


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, int | float) else "-"


def _power(c: Any, delta: float | None) -> bool:
    """Whether ``c`` could see a deviation of ``delta`` (a short-form marker: assumed)."""
    return delta is None or (isinstance(c.limit, int | float) and c.limit < delta)


def _judge(b: Behaviour, mine: list[Any], measured: dict[int, bool]) -> None:
    """A check that failed without a value (nothing was measured: a missing probe or figure)
    shows nothing and stays a failure."""
    mine = [c for c in mine if measured[id(c)] or c.value is not None]
    failed = [c for c in mine if not measured[id(c)]]
    powered = [c for c in mine if _power(c, b.checks[c.name])]
    for c in mine:
        c.xfail = b.reason
        if failed:
            c.expected_state, c.passed = "shown", True
            c.detail += f"; expected to fail: {b.reason}" if c in failed else \
                f"; passed here, the behaviour is shown by {', '.join(f.name for f in failed)}: {b.reason}"
        elif powered:
            c.expected_state, c.passed = "gone", False
            c.detail += f"; expected to fail ({b.reason}) but passed: remove the marker"
            if b.checks[c.name] is not None:
                c.detail += f" (the limit {_fmt(c.limit)} would have seen the recorded {_fmt(b.checks[c.name])})"
        else:
            c.expected_state, c.passed = "inconclusive", True
            seen = "; ".join(f"{x.name} limit {_fmt(x.limit)} vs recorded {_fmt(b.checks[x.name])}" for x in mine)
            c.detail += (f"; inconclusive: passed, but no check of the behaviour could see the deviation its "
                         f"marker recorded ({seen}): {b.reason}")
