"""mlx.launch without its busy waits: ``python -m harness.controller.calm_launch ARGS`` is
``mlx.launch ARGS``.

mlx.launch waits for its ranks in ``select`` calls that also watch each rank's stdin pipe (always
writable) and its own stdin (at end of file, /dev/null is always readable): with no input to
forward, every wait returns at once and the launcher spins more than one CPU core for as long as
the ranks run (5.8 CPU-seconds in 4.2 s for two sleeping ranks on Linux). The harness forwards no
input (its launcher's stdin is /dev/null; ranks write their output to files), so here those waits
watch only the ranks' output pipes and sleep at most ``WAIT_S``.

mlx.launch logs a rank that exits 0 ("Node with rank N completed") only with ``--verbose``, which
also prints its commands; here that line is always logged, so the launcher log names every
rank's exit status within ``WAIT_S`` of its exit (``harness.controller.launch.launcher_exits``).
Everything else is mlx.launch's; where it has no such ``select`` or ``log`` (another MLX
version), it runs unchanged.
"""

from __future__ import annotations

import select
import sys
import time
from collections.abc import Callable
from typing import Any

WAIT_S = 0.02  # how late an exit or a line of output can be noticed
STDIN_FD = 0  # what mlx.launch's sys.stdin.fileno() is


def quiet_select(rlist: list[Any], wlist: list[Any], xlist: list[Any], timeout: float | None = None
                 ) -> tuple[list[Any], list[Any], list[Any]]:
    """``select.select`` that never reports stdin or a writable pipe, waiting at most ``WAIT_S``."""
    rlist = [fd for fd in rlist if fd != STDIN_FD]
    wait = WAIT_S if timeout is None else min(timeout, WAIT_S)
    if not rlist and not xlist:
        time.sleep(wait)
        return [], [], []
    ready, _, failed = select.select(rlist, [], xlist, wait)
    return ready, [], failed


EXIT_LINE = "Node with rank "


def logging_exits(log: Callable[..., None]) -> Callable[..., None]:
    """mlx.launch's ``log(verbose, *args)`` that also logs its rank exit lines when not verbose."""

    def log_exits(verbose: bool, *args: Any, **kwargs: Any) -> None:
        log(verbose or bool(args and str(args[0]).startswith(EXIT_LINE)), *args, **kwargs)

    return log_exits


def main() -> int:
    from mlx._distributed_utils import launch

    if getattr(launch, "select", None) is select.select:
        launch.select = quiet_select
    if callable(getattr(launch, "log", None)):
        launch.log = logging_exits(launch.log)
    return launch.main() or 0


if __name__ == "__main__":
    sys.exit(main())
