"""Floor runs side by side (``harness.controller.side_by_side``): the scheduling, and the order
``scenario_runs`` launches a scenario's runs in, on real ranks; the interruption of real floor runs
under ``mlx.launch`` is in tests/test_interrupt.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from harness.controller.side_by_side import Cancel, Cancelled, run_side_by_side, width
from tests.conftest import cli, write_scenario


def test_runs_go_at_once_and_are_handed_on_in_the_order_given() -> None:
    both = threading.Barrier(2, timeout=10)  # broken (an error) unless two launches are in flight at once
    ends = {"a": 0.3, "b": 0.0, "c": 0.0}

    def launch(name: str, cancel: Cancel) -> str:
        if name in ("a", "b"):
            both.wait()
        time.sleep(ends[name])
        return name

    seen: list[str] = []

    def done(outcome: str) -> None:
        assert threading.current_thread() is threading.main_thread()
        seen.append(outcome)

    got = run_side_by_side(["a", "b", "c"], launch, on_done=done, at_once=2)
    assert got == {"a": "a", "b": "b", "c": "c"}
    assert seen == ["a", "b", "c"]  # b and c ended first; a's outcome is handed on first all the same


def test_a_run_that_raises_stops_the_others_and_its_error_is_raised() -> None:
    stopped = threading.Event()
    started = threading.Event()

    launched: list[str] = []

    def launch(name: str, cancel: Cancel) -> str:
        launched.append(name)
        if name == "bad":
            started.wait(10)
            raise RuntimeError("could not start ranks for run 'bad'")
        started.set()
        try:
            while True:  # a watchdog's polls
                cancel.check()
                time.sleep(0.01)
        except Cancelled as e:
            assert isinstance(e.cause, RuntimeError)
            stopped.set()
            raise

    seen: list[str] = []
    with pytest.raises(RuntimeError, match="could not start ranks"):
        run_side_by_side(["long", "bad", "never"], launch, on_done=seen.append, at_once=2)
    assert stopped.is_set() and seen == [] and "never" not in launched


def test_width_is_one_a_core_and_at_most_the_runs() -> None:
    assert [width(runs, cores=2) for runs in (0, 1, 2, 6)] == [1, 1, 2, 2]
    assert width(3, cores=16) == 3 and width(5, cores=1) == 1


@pytest.mark.ranks
def test_the_reference_goes_first_wherever_the_file_names_it(tmp_path: Path) -> None:
    """``ddp2`` is written before ``single``, its reference: the reference still runs first and
    records its probes, so ``ddp2``'s step-local checks are measured (launched in file order, they
    found no probes and failed)."""
    path = write_scenario(tmp_path, "order", (2, 1))
    p = cli("run", str(path), "--out", str(tmp_path / "o"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    (s,) = json.loads((tmp_path / "o" / "result.json").read_text())["scenarios"]
    step = {c["name"]: c for c in s["checks"] if c["name"].startswith("step_") and c["run"] == "ddp2"}
    assert set(step) == {"step_token_parity", "step_loss_parity", "step_grad_parity"}
    assert all(c["result"] == "pass" and c["value"] is not None for c in step.values()), step
