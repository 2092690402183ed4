"""What mlx.launch runs for a warm-started rank (``harness.rank.warm``), as
``python -I -S warm_client.py SOCKET RUN_DIR``: it hands the rank's argument, environment,
directory and standard streams to the server, passes on every signal it can catch to the rank,
and ends as the rank ended (its exit code, or killed by its signal). Where no server answers, it
becomes the rank itself (``python -m harness.rank RUN_DIR``). Standard library only, by path:
it must start in milliseconds."""

import json
import os
import signal
import socket
import struct
import sys

RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main_thread_signal():  # noqa: ANN201 - harness/main_thread_signal.py, loaded by path once a signal comes
    import importlib.util

    if "main_thread_signal" not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "main_thread_signal.py")
        spec = importlib.util.spec_from_file_location("main_thread_signal", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["main_thread_signal"] = module
    return sys.modules["main_thread_signal"]


def cold(run_dir: str) -> None:
    os.execv(sys.executable, [sys.executable, "-m", "harness.rank", run_dir])


def receive(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            return b""
        out += chunk
    return out


def write_usage(data: bytes) -> None:
    """The rank's resource use, where the server said (``schema.warm_rusage_path``)."""
    try:
        usage = json.loads(data)
        path = usage["path"]
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(usage["record"], f)
        os.replace(tmp, path)
    except (OSError, ValueError, KeyError):
        pass  # the run's directory is gone, or the server sent nothing: nobody will read it


def main() -> None:
    sock_path, run_dir = sys.argv[1], sys.argv[2]
    rank_pid = 0
    pending: list[int] = []

    def relay(sig: int, _frame: object) -> None:
        if rank_pid:
            try:
                main_thread_signal().send(rank_pid, sig)
            except ProcessLookupError:
                pass
        else:
            pending.append(sig)

    for sig in RELAYED:
        signal.signal(sig, relay)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sock_path)
        request = json.dumps({"argv": [run_dir], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(conn, [struct.pack("!I", len(request))], [0, 1, 2])
        conn.sendall(request)
        answer = receive(conn, 5)
    except OSError:
        answer = b""
    if answer[:1] != b"P":  # no server, or it refused: start the rank here, as a cold start does
        conn.close()
        for sig in RELAYED:
            signal.signal(sig, signal.SIG_DFL)
        for sig in pending:
            os.kill(os.getpid(), sig)
        cold(run_dir)
    rank_pid = struct.unpack("!i", answer[1:])[0]
    for sig in pending:
        relay(sig, None)
    end = receive(conn, 9)
    if end[:1] != b"E":
        print(f"warm start: the server of rank pid {rank_pid} went away", file=sys.stderr)
        os._exit(1)
    status, size = struct.unpack("!iI", end[1:])
    write_usage(receive(conn, size))
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig in RELAYED:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
