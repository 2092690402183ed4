"""The stack-dump signal reaches a process's main thread even while that thread blocks signals
for a moment (as glibc's ``pthread_create`` does) and another thread does not: a process-directed
``os.kill`` is taken by the other thread, and faulthandler prints that thread's stack, not the
main one's (a library's thread has none: the dump is lost)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from harness import main_thread_signal

CHILD = """
import faulthandler, signal, sys, threading, time
faulthandler.register(signal.SIGUSR1, all_threads=False)

def other_thread():
    while True:
        time.sleep(0.01)

def sent_to_the_process():  # SIGUSR1 sent to the process, not yet taken by a thread (ShdPnd: the shared queue)
    with open("/proc/self/status") as f:
        pending = next(int(line.split()[1], 16) for line in f if line.startswith("ShdPnd:"))
    return bool(pending & (1 << (signal.SIGUSR1 - 1)))

def main_thread():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    print("blocked", flush=True)
    sys.stdin.readline()  # until the parent has sent the signal
    deadline = time.monotonic() + 30  # one sent to the process waits for a thread that does not block it to
    while sent_to_the_process() and time.monotonic() < deadline:  # run (a loaded machine): unblocking
        time.sleep(0.001)  # now would hand it to this thread
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    time.sleep(0.2)

threading.Thread(target=other_thread, daemon=True).start()
main_thread()
"""


def dumped_stack(send) -> str:  # noqa: ANN001
    """The child's stderr after ``send(pid, SIGUSR1)`` while its main thread blocks the signal."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "blocked\n"
    send(child.pid, signal.SIGUSR1)
    _, err = child.communicate("sent\n", timeout=30)
    assert child.returncode == 0, err
    return err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="one thread of another process: Linux's tgkill")
def test_the_signal_waits_for_the_main_thread_where_os_kill_gives_it_to_another() -> None:
    to_main = dumped_stack(main_thread_signal.send)
    assert "in main_thread" in to_main and "in other_thread" not in to_main, to_main
    to_process = dumped_stack(os.kill)  # what the senders did before: the other thread's stack
    assert "in other_thread" in to_process and "in main_thread" not in to_process, to_process


def test_a_gone_process_is_a_lookup_error_as_with_os_kill() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(ProcessLookupError):
        main_thread_signal.send(child.pid, 0)
