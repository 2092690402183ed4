"""The exit codes of every ``mlx-ddp-harness`` command, and how a fault in the harness itself
ends one. Standard library only: the command's entry point reads it before anything else loads."""

from __future__ import annotations

import sys
import traceback

EXIT_PASS, EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_INFRA = 0, 1, 2, 3
EXIT_INCONCLUSIVE = 4  # run: no check failed, one could not decide; gate: none failed, one could not decide
EXIT_INTERNAL = 5  # any command: a fault in the harness itself (its traceback on stderr), never a verdict


def internal_fault(e: BaseException, doing: str = "") -> int:
    """Say on stderr that ``e`` (raised while ``doing``) is a fault in the harness, with its
    traceback, and give the code to exit with: never 1, which reads as "a check failed"."""
    traceback.print_exception(e)
    where = f" while {doing}" if doing else ""
    print(f"internal error{where}: {type(e).__name__}: {e} (a fault in mlx-ddp-harness, not a verdict)",
          file=sys.stderr)
    return EXIT_INTERNAL
