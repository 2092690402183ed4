"""Runs that read nothing from each other (a scenario's floor runs) launched side by side, each in
a thread of its own, as many at once as the machine has cores: each still takes its rank slots
(``rank_budget``), so together they never hold more ranks than the budget.

The main thread alone is interrupted (Ctrl-C, or SIGTERM raised as ``SystemExit``). It then sets
a ``Cancel`` that each run's watchdog checks at every poll: each running run is stopped as an
interrupted run is (its ranks killed, what they wrote kept and marked), a run still queued for
slots starts nothing, and the main thread raises what interrupted it once every run's thread has
ended (a second Ctrl-C meanwhile does not cut that wait short). A run that raises (a launch that
failed) cancels the rest the same way, and its error is raised. Outcomes are handed on in the
order given, whatever order the runs end in. One run at a time needs none of this: the caller
runs those in its own thread (``scenario_runs``)."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence

from harness.controller.outcome import RunOutcome


class Cancelled(Exception):
    """Raised in a run's thread once the main thread was interrupted by ``cause``."""

    def __init__(self, cause: BaseException):
        super().__init__(f"cancelled: {type(cause).__name__}")
        self.cause = cause


class Cancel:
    """Set once, by the thread that was interrupted; read by the runs' watchdogs."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.cause: BaseException | None = None

    def set(self, cause: BaseException) -> None:
        if not self.event.is_set():
            self.cause = cause
            self.event.set()

    def check(self) -> None:
        if self.event.is_set():
            raise Cancelled(self.cause or KeyboardInterrupt())


def width(runs: int, cores: int | None = None) -> int:
    """How many runs go at once: one a core, at most ``runs``."""
    return max(1, min(runs, cores if cores is not None else os.cpu_count() or 1))


def run_side_by_side(
    names: Sequence[str],
    launch: Callable[[str, Cancel], RunOutcome],
    on_done: Callable[[RunOutcome], None] | None = None,
    at_once: int | None = None,
) -> dict[str, RunOutcome]:
    """``launch(name, cancel)`` for each of ``names``, ``at_once`` (default ``width``) at a time;
    ``on_done`` is called in the main thread, in ``names``' order, as each outcome can be."""
    todo: queue.Queue[str] = queue.Queue()
    for name in names:
        todo.put(name)
    done: queue.Queue[tuple[str, RunOutcome | None, BaseException | None]] = queue.Queue()
    cancel = Cancel()

    def worker() -> None:
        while not cancel.event.is_set():
            try:
                name = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((name, launch(name, cancel), None))
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
                if not isinstance(e, Cancelled):
                    cancel.set(e)  # no other worker starts another run meanwhile
                done.put((name, None, e))

    threads: list[threading.Thread] = []
    outcomes: dict[str, RunOutcome] = {}
    error: BaseException | None = None
    told = 0
    try:
        for k in range(at_once or width(len(names))):
            threads.append(threading.Thread(target=worker, name=f"run-{k}"))
            threads[-1].start()
        while len(outcomes) < len(names) and error is None:
            name, outcome, raised = done.get()
            if raised is not None:
                error = raised.cause if isinstance(raised, Cancelled) else raised
                continue
            outcomes[name] = outcome
            while told < len(names) and names[told] in outcomes:
                if on_done:
                    on_done(outcomes[names[told]])
                told += 1
    except BaseException as e:  # Ctrl-C or a signal, in this thread: stop the others' runs
        error = e
    if error is not None:
        cancel.set(error)
        while any(t.is_alive() for t in threads):  # each run stops within a poll of its watchdog or its
            try:  # slot queue, kills its ranks and removes its directory
                for t in threads:
                    t.join()
            except BaseException:  # noqa: BLE001 - a second Ctrl-C: the runs are being stopped already
                continue
        raise error
    return outcomes
