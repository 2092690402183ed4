"""A signal to another process's main thread (standard library only: the warm client loads this
file by path, the controller and a host's agent import it).

``os.kill`` makes a signal the process's: the kernel hands it to any thread that does not block
it. A rank's main thread blocks every signal for a moment each time it starts a thread (glibc's
``pthread_create`` does), and a library's thread (MLX's, OpenBLAS's) that takes the stack-dump
signal then has no Python stack for faulthandler to print: the dump is lost. Where the system can
address one thread of another process (Linux ``tgkill``), the signal waits for the main thread
instead; elsewhere it goes as ``os.kill`` sends it."""

from __future__ import annotations

import os
import sys
from typing import Any

_libc: Any = None


def _tgkill() -> Any:
    global _libc
    if _libc is None:
        import ctypes

        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _libc = False
    return getattr(_libc, "tgkill", None) if _libc else None


def send(pid: int, sig: int) -> None:
    """``sig`` to ``pid``'s main thread (its thread id is the process's id), else to ``pid``;
    raises ``ProcessLookupError`` where the process is gone, as ``os.kill`` does. A process whose
    main thread ended while others run (never a Python rank) would not take it."""
    tgkill = _tgkill() if sys.platform.startswith("linux") else None
    if tgkill is not None and tgkill(int(pid), int(pid), int(sig)) == 0:
        return
    os.kill(pid, sig)  # no tgkill, or it failed (the process is gone: os.kill says so as ever)
