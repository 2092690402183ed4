"""Warm rank starts, the controller's side: with ``MLX_DDP_HARNESS_WARM_RANKS=DIR`` set, a local
launch on a Linux machine without a GPU starts each rank through a server that has imported what
ranks of its kind import (``harness.rank.warm``), instead of a fresh interpreter. A rank's own
work is the same; what it saves is the imports (0.35 CPU-s for a reference rank, 1.1 to 1.5 more
for an external trainer's libraries), which is most of a short rank on a small machine. The
start-up figures of such a run do not hold the imports: the test suite uses it, reports do not.

One server per key: the job's trainer, the packages it hides and its model's architecture (what
a rank imports before its first step), the environment that can change an import (the
interpreter, ``LD_PRELOAD``, ``PYTHON*``, ``MLX_*``, BLAS and Hugging Face settings), and the
harness's own source files (each one's path, size and modification time): a server started
before the harness changed holds its older modules, and is not forked from again. Every server
preloads the ring-yield library (``ring_yield``), switched on only in the ranks of a launch that
yields, so that library is not in the key: a one-process launch and a ring launch that fills the
cores, otherwise alike, share a server. A launch
whose server is not up yet starts it and waits for its imports; a launch whose server refused
(a library started a thread, which a fork would not keep) or does not answer runs cold.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import schema
from harness.controller import ring_yield

WARM_VAR = "MLX_DDP_HARNESS_WARM_RANKS"
HARNESS = Path(__file__).resolve().parents[1]
CLIENT = HARNESS / "rank" / "warm_client.py"
SERVER_MODULE = "harness.rank.warm"
KEYED_PREFIXES = ("MLX_", "PYTHON", "LD_", "OPENBLAS_", "OMP_", "HF_", "TRANSFORMERS_", "TOKENIZERS_")
SERVER_START_S = 30.0  # the longest a launch waits for its server's imports
UNKEYED = ("MLX_DDP_HARNESS_", "MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE")  # per run: read after the fork
# Set by the trainers' libraries as they are imported (unsloth-zoo: hf-xet's download tuning and
# tokenizer threads; mlx-lm and mlx-vlm: transformers' advice and log level), so a process that has
# imported one (a test process, a controller) hands them to its launches and a fresh one does not.
# They tune downloads, tokenizer threads and log output, none of which a rank's computation reads;
# a warm rank keeps its server's transformers log level and hf-xet settings read at import.
SET_BY_IMPORTS = ("HF_XET_HIGH_PERFORMANCE", "HF_XET_HP", "HF_XET_CHUNK_CACHE_SIZE_BYTES",
                  "HF_XET_DATA_MAX_CONCURRENT_FILE_DOWNLOADS", "HF_XET_CLIENT_AC_INITIAL_DOWNLOAD_CONCURRENCY",
                  "HF_XET_CLIENT_AC_MIN_DOWNLOAD_CONCURRENCY", "HF_XET_CLIENT_AC_MAX_DOWNLOAD_CONCURRENCY",
                  "HF_XET_RECONSTRUCTION_DOWNLOAD_BUFFER_SIZE", "HF_XET_RECONSTRUCTION_DOWNLOAD_BUFFER_LIMIT",
                  "HF_XET_RECONSTRUCTION_DOWNLOAD_BUFFER_PERFILE_SIZE", "HF_XET_RECONSTRUCTION_MIN_PREFETCH_BUFFER",
                  "TOKENIZERS_PARALLELISM", "TRANSFORMERS_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS")


def warm_dir() -> Path | None:
    """The servers' directory, where warm starts are asked for and can be had."""
    value = os.environ.get(WARM_VAR)
    if not value or not sys.platform.startswith("linux"):
        return None
    from harness.controller.devices import accelerators

    if accelerators().kind != "cpu":
        return None
    return Path(value)


@functools.lru_cache(maxsize=4)
def harness_code(root: Path = HARNESS) -> str:
    """What the source files under ``root`` (the harness's) are: a digest of each one's path,
    size and modification time (read once a process)."""
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        st = f.stat()
        h.update(f"{f.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def key_of(job: dict[str, Any], env: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """The server a rank of ``job`` started with ``env`` forks from: its name, and what it holds."""
    trainer = job.get("trainer") or {}
    what = {
        "kind": job.get("kind"),
        "module": trainer.get("module"),
        "hides": trainer.get("hides"),
        "arch": ((job.get("scenario") or {}).get("model") or {}).get("arch"),
        "python": sys.executable,
        "harness": harness_code(),
        "env": {k: (ring_yield.without(v) if k == "LD_PRELOAD" else v) for k, v in sorted(env.items())
                if k.startswith(KEYED_PREFIXES) and not k.startswith(UNKEYED) and k not in SET_BY_IMPORTS},
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16], what


def _held(lock: Path) -> bool:
    """Whether a server holds (or is starting with) this lock."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _start_server(directory: Path, key: str, job_file: Path, env: dict[str, str], what: dict[str, Any]) -> None:
    for name, data in (("job.json", job_file.read_bytes()), ("key.json", json.dumps(what).encode())):
        path = schema.warm_server_path(directory, key, name)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    # Every server preloads the ring-yield library, off in itself: its ranks switch it on or off
    # (ring_yield.ACTIVE_VAR), so a one-process launch and a yielding ring launch share a server.
    server_env = {**env, "TMPDIR": env.get("MLX_DDP_HARNESS_TMPDIR", "/tmp"),
                  "LD_PRELOAD": ring_yield.with_library(env.get("LD_PRELOAD", "")), ring_yield.ACTIVE_VAR: "0"}
    with open(schema.warm_server_path(directory, key, "log"), "ab") as log:
        subprocess.run([sys.executable, "-m", SERVER_MODULE, str(directory), key], env=server_env, cwd=directory,
                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, check=False, timeout=30)


def rank_argv(run_dir: Path, env: dict[str, str]) -> list[str] | None:
    """The arguments before the run directory that start a rank of ``run_dir``'s job warm
    (``python`` plus these plus the directory), or None for a cold start. Starts the key's server
    where none holds it."""
    directory = warm_dir()
    if directory is None:
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        job_file = run_dir / schema.JOB_FILE
        key, what = key_of(json.loads(job_file.read_text()), env)
        if not _held(schema.warm_server_path(directory, key, "lock")) and not _refused(directory, key):
            _start_server(directory, key, job_file, env, what)
        if not _serving(directory, key):
            return None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return ["-I", "-S", str(CLIENT), str(schema.warm_server_path(directory, key, "sock"))]


def _serving(directory: Path, key: str) -> bool:
    """Wait for the key's server to finish its imports (so a first launch does not import them
    twice, in the server and in cold ranks): whether it serves."""
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if _refused(directory, key):  # its imports start a thread: no fork is safe
            return False
        if schema.warm_server_path(directory, key, "sock").exists():
            return True
        if not _held(schema.warm_server_path(directory, key, "lock")):  # it ended without serving
            return False
        time.sleep(0.02)
    return False


def _refused(directory: Path, key: str) -> bool:
    return schema.warm_server_path(directory, key, "refused").exists()


def shell_words(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def rank_cpu_s(run_dir: Path, world_size: int) -> float:
    """The CPU-seconds of a run's warm-started ranks, as their server waited for them (0 for
    cold ranks, which the launcher waited for)."""
    total = 0.0
    for r in range(world_size):
        try:
            total += float(json.loads(schema.warm_rusage_path(run_dir, r).read_text())["cpu_s"])
        except (OSError, ValueError, KeyError):
            continue
    return total


def stop_servers(directory: Path) -> None:
    """End every server of ``directory`` (their ranks die with them)."""
    import signal

    for lock in directory.glob("*.lock"):
        try:
            pid = int(lock.read_text() or 0)
            if pid and _held(lock):
                os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):
            continue
