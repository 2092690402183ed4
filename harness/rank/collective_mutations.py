"""Collective mutations: DDP bugs planted in any Python trainer's gradient all-reduce, with no
change to its code, through the collective ledger's interposition (``harness.rank.ledger``).

A run's ``mutation`` names one of ``COLLECTIVE_MUTATIONS`` (``harness.scenario.names``). It acts
on each ``all_sum`` of a gradient: a floating array of more than one element issued from the
trainer's own code (a call site outside MLX and the harness: the harness's own consensus and
device-check collectives are left alone, and so are scalar sums, the loss and token counts).

Three change what the all-reduce returns, on every rank alike, so the ranks still issue the same
collectives and the run completes: a check has to catch what it did to the training. Two change
when the last rank arrives, once, at its first gradient all-reduce of step ``AT_STEP`` (in a
compiled step, as the step that holds one is called): ``straggler`` sleeps ``STRAGGLER_S`` there
(the run must pass, the others' wait shows in their step time) and ``rank_killed`` sends itself
SIGKILL (the run must fail with that rank named). Each emits a ``fault`` event (phase
``collective``) just before it acts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from harness.scenario.names import TIMED_MUTATION_STEP as AT_STEP

STRAGGLER_S = 1.5
TIMED = ("straggler", "rank_killed")


_measuring = threading.local()


@contextlib.contextmanager
def measuring() -> Iterator[None]:
    """Collectives the harness issues to measure the trainer (the defect hypotheses at a probe)
    are never mutated, though a trainer's frames are below them on the stack."""
    before = getattr(_measuring, "on", False)
    _measuring.on = True
    try:
        yield
    finally:
        _measuring.on = before


def is_measuring() -> bool:
    return getattr(_measuring, "on", False)


def is_gradient(x: Any) -> bool:
    import mlx.core as mx

    return isinstance(x, mx.array) and x.size > 1 and mx.issubdtype(x.dtype, mx.floating)


def mutated_all_sum(mutation: str, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    rank: int, world_size: int) -> Any:
    """What ``all_sum(*args, **kwargs)`` returns under ``mutation``."""

    x, rest = (args[0], args[1:]) if args else (kwargs["x"], ())
    kw = {k: v for k, v in kwargs.items() if k != "x"}
    group = kw.get("group")
    if group is not None:
        rank, world_size = group.rank(), group.size()
    if mutation == "allreduce_skipped":  # each rank keeps its own gradient
        return x
    if mutation == "allreduce_not_averaged":  # the sum arrives N times what an average would be
        return original(x, *rest, **kw) * world_size
    if mutation == "rank_dropped":  # the last rank's contribution never reaches the sum
        # x * 0, not zeros: an input that does not depend on the gradient lets MLX run this rank's
        # collectives in another order than the other ranks' (they then wait for each other)
        return original(x * 0 if rank == world_size - 1 else x, *rest, **kw)
    if mutation in TIMED:  # the value is left alone: ``CollectiveMutation.arrive`` acted before the call
        return original(*args, **kwargs)
    raise ValueError(f"unknown collective mutation {mutation!r}")


class CollectiveMutation:
    """One rank's mutation; ``emit`` writes its events (``fault`` when a timed one acts)."""

    def __init__(self, name: str, rank: int, world_size: int, emit: Callable[..., None]):
        self.name, self.rank, self.world_size, self.emit = name, rank, world_size, emit
        self._fired = False

    def all_sum(self, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return mutated_all_sum(self.name, original, args, kwargs, self.rank, self.world_size)

    def arrive(self, step: int, site: str) -> None:
        """This rank is about to issue a gradient all-reduce (or call a compiled step holding one)
        at ``step``: a timed mutation acts here, on the last rank, once."""
        if self.name not in TIMED or self._fired or step != AT_STEP or self.rank != self.world_size - 1:
            return
        self._fired = True
        if self.name == "straggler":
            self.emit("fault", rank=self.rank, step=step, phase="collective", action="delay", seconds=STRAGGLER_S,
                      site=site)
            time.sleep(STRAGGLER_S)
        else:
            self.emit("fault", rank=self.rank, step=step, phase="collective", action="sigkill", site=site)
            os.kill(os.getpid(), signal.SIGKILL)
