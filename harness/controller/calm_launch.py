"""mlx.launch without its busy waits: ``python -m harness.controller.calm_launch ARGS`` is
``mlx.launch ARGS``.

mlx.launch waits for its ranks in ``select`` calls that also watch each rank's stdin pipe (always
writable) and its own stdin (at end of file, /dev/null is always readable): with no input to
forward, every wait returns at once and the launcher spins more than one CPU core for as long as
the ranks run (5.8 CPU-seconds in 4.2 s for two sleeping ranks on Linux). The harness forwards no
input (its launcher's stdin is /dev/null; ranks write their output to files), so here those waits
watch only the ranks' output pipes and sleep at most ``WAIT_S``; everything else is mlx.launch's.
Where mlx.launch has no such ``select`` (another MLX version), it runs unchanged.
"""

from __future__ import annotations

import select
import sys
import time
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


def main() -> int:
    from mlx._distributed_utils import launch

    if getattr(launch, "select", None) is select.select:
        launch.select = quiet_select
    return launch.main() or 0


if __name__ == "__main__":
    sys.exit(main())
