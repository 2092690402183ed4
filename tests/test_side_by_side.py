"""Floor runs side by side (``harness.controller.side_by_side``): the pure scheduling here; the
interruption of real floor runs under ``mlx.launch`` is in tests/test_interrupt.py."""

from __future__ import annotations

import threading
import time

import pytest

from harness.controller.side_by_side import Cancel, Cancelled, run_side_by_side, width


def test_runs_go_at_once_and_are_handed_on_in_the_order_given() -> None:
    both = threading.Barrier(2, timeout=10)  # broken (an error) unless two launches are in flight at once
    ends = {"a": 0.3, "b": 0.0, "c": 0.0}

    def launch(name: str, cancel: Cancel) -> str:
        if name in ("a", "b"):
            both.wait()
        time.sleep(ends[name])
        return name

    seen: list[str] = []
    got = run_side_by_side(["a", "b", "c"], launch, on_done=seen.append, at_once=2)
    assert got == {"a": "a", "b": "b", "c": "c"}
    assert seen == ["a", "b", "c"]  # b and c ended first; a's outcome is handed on first all the same


def test_a_run_that_raises_stops_the_others_and_its_error_is_raised() -> None:
    stopped = threading.Event()
    started = threading.Event()

    def launch(name: str, cancel: Cancel) -> str:
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
    assert stopped.is_set() and seen == []


def test_width_is_one_a_core_and_at_most_the_runs() -> None:
    assert [width(runs, cores=2) for runs in (0, 1, 2, 6)] == [1, 1, 2, 2]
    assert width(3, cores=16) == 3 and width(5, cores=1) == 1
