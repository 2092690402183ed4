"""MLX's CPU kernels compiled in a quarter of the time: their preamble, precompiled once a machine.

On Linux MLX compiles each fused CPU kernel (what ``mx.compile`` makes of a graph's element-wise
ops) the first time it meets it: it writes C++ source into its kernel cache,
``$TMPDIR/mlx/<version>/cpu``, and runs ``g++ -std=c++17 -O3 -Wall -fPIC -shared -I <mlx's
include dir>`` on it. Ranks use the controller's temp dir (``harness.rank.entry``), so every run on
the machine shares that cache, but a fresh machine (a CI runner) compiles every kernel once, and
each compile spends most of its time parsing the header every source includes first,
``mlx/backend/cpu/compiled_preamble.h``: 0.55 CPU-s a kernel on a 2-core x86 VM, 0.12 with the
header precompiled (docs/development.md).

GCC looks for ``<header>.gch`` in each directory it searches, before the header itself, and it
searches the including file's own directory first. So a precompiled header at
``<cache>/mlx/backend/cpu/compiled_preamble.h.gch``, built from MLX's header with MLX's flags, is
used by every kernel compile; the kernels come out instruction for instruction the same. GCC
ignores a precompiled header it cannot use (another compiler version or other flags) and parses
the header as before. It is built once, under a lock, and rebuilt when MLX's headers or the
compiler change (``KEY_SUFFIX`` holds what it was built from); without ``g++`` or off Linux
nothing is done.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata, util
from pathlib import Path

PREAMBLE = Path("mlx") / "backend" / "cpu" / "compiled_preamble.h"
FLAGS = ("-std=c++17", "-O3", "-Wall", "-fPIC")  # MLX's own (less -shared, which only links)
KEY_SUFFIX = ".key"


def include_dir() -> Path | None:
    """MLX's installed headers (``-I`` of its kernel compiles), or None where it ships none."""
    spec = util.find_spec("mlx")
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / "include" / PREAMBLE).is_file():
            return Path(root) / "include"
    return None


def cache_dir(temp: str | None = None) -> Path:
    """Where MLX keeps its compiled CPU kernels for ranks started here."""
    return Path(temp or tempfile.gettempdir()) / "mlx" / metadata.version("mlx") / "cpu"


def _key(include: Path, compiler: str) -> str:
    """What a precompiled header depends on: every header's name, size and time, and the compiler."""
    h = hashlib.sha256()
    for path in sorted((include / "mlx").rglob("*.h")):
        st = path.stat()
        h.update(f"{path.relative_to(include)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    st = Path(compiler).resolve().stat()
    h.update(f"{Path(compiler).resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def prepare(cache: Path | None = None) -> Path | None:
    """Build the precompiled preamble into ``cache`` (MLX's kernel cache for ranks started here by
    default) unless it is there and current; returns its path, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    compiler, include = shutil.which("g++"), include_dir()
    if compiler is None or include is None:
        return None
    try:
        cache = cache or cache_dir()
        out = cache / f"{PREAMBLE}.gch"
        key_file = out.with_name(out.name + KEY_SUFFIX)
        key = _key(include, compiler)
        if out.exists() and key_file.exists() and key_file.read_text() == key:
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_name(out.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builds; the others find it built
            if out.exists() and key_file.exists() and key_file.read_text() == key:
                return out
            key_file.unlink(missing_ok=True)
            out.unlink(missing_ok=True)  # built from other headers: no compile may read it meanwhile
            fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".gch")
            os.close(fd)
            done = subprocess.run([compiler, *FLAGS, "-I", str(include), "-x", "c++-header",
                                   str(include / PREAMBLE), "-o", tmp], capture_output=True, timeout=300)
            if done.returncode != 0:
                os.unlink(tmp)
                return None
            os.chmod(tmp, 0o644)  # as MLX's own files there: readable by whoever shares the temp dir
            os.replace(tmp, out)
            key_file.write_text(key)
        return out
    except (OSError, subprocess.SubprocessError, metadata.PackageNotFoundError):
        return None  # MLX compiles as it always did


@functools.cache
def prepared() -> Path | None:
    """``prepare()``, once a process."""
    return prepare()
