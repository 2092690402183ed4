"""MLX's CPU kernels compiled in a quarter of the time: their preamble, precompiled once a machine.

On Linux MLX compiles each fused CPU kernel (what ``mx.compile`` makes of a graph's element-wise
ops) the first time it meets it: it writes C++ source into its kernel cache,
``$TMPDIR/mlx/<version>/cpu``, and runs ``g++ -std=c++17 -O3 -Wall -fPIC -shared -I <mlx's
include dir>`` on it. Ranks use their controller's temp dir (``harness.rank.entry``), so the runs
of controllers with one ``TMPDIR`` share that cache; but a fresh machine (a CI runner) compiles
every kernel once, and each compile spends most of its time parsing the header every source
includes first, ``mlx/backend/cpu/compiled_preamble.h``: 0.44 CPU-s of 0.55 a kernel on a 2-core
x86 VM, 0.09 of 0.12 with the header precompiled (docs/development.md).

GCC looks for ``<header>.gch`` in each directory it searches, before the header itself, and it
searches the including file's own directory first. So a precompiled header at
``<cache>/mlx/backend/cpu/compiled_preamble.h.gch``, built from MLX's header with MLX's flags, is
used by every kernel compile; the kernels come out instruction for instruction the same. GCC
ignores a precompiled header it cannot use (another compiler version, or flags such as ``-mavx``
that a differently built MLX adds) and parses the header as before. It is built once, under a
lock, and rebuilt when what it was built from changes: the files the build read (``DEPS_SUFFIX``:
MLX's headers compared by content, so two installs of one MLX share it, the system headers by
size and time) and the compiler. Without ``g++`` or off Linux nothing is done.
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
KEY_SUFFIX = ".key"  # a digest of what it was built from
DEPS_SUFFIX = ".deps"  # the files the build read


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


def _read_by_build(make_rule: Path, include: Path) -> list[str]:
    """The files a build read, from the make rule GCC wrote (``-MD -MF``): MLX's headers named
    relative to its include dir (``mlx:<path>``), any other by its path."""
    rule = make_rule.read_text().replace("\\\n", " ")
    out = []
    for dep in rule.split(":", 1)[1].split():
        path = Path(dep)
        out.append(f"mlx:{path.relative_to(include)}" if path.is_relative_to(include) else str(path))
    return out


def _key(deps: list[str], include: Path, compiler: str) -> str:
    """What the precompiled header was built from: MLX's headers by content (two installs of one
    MLX agree), every other file the build read by path, size and time (a system header updated
    since), and the compiler."""
    h = hashlib.sha256()
    for dep in [*deps, str(Path(compiler).resolve())]:
        if dep.startswith("mlx:"):
            h.update(f"{dep}\0{hashlib.sha256((include / dep[4:]).read_bytes()).hexdigest()}\n".encode())
        else:
            st = Path(dep).stat()
            h.update(f"{dep}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _current(out: Path, include: Path, compiler: str) -> bool:
    key_file, dep_file = out.with_name(out.name + KEY_SUFFIX), out.with_name(out.name + DEPS_SUFFIX)
    try:
        return out.exists() and key_file.read_text() == _key(dep_file.read_text().splitlines(), include, compiler)
    except (OSError, ValueError):  # missing, unreadable or a header gone: build it again
        return False


def prepare(cache: Path | None = None) -> Path | None:
    """Build the precompiled preamble into ``cache`` (MLX's kernel cache for ranks started here by
    default) unless it is there and current; returns its path, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    tmp: str | None = None
    try:
        compiler, include = shutil.which("g++"), include_dir()
        if compiler is None or include is None:
            return None
        cache = cache or cache_dir()
        out = cache / f"{PREAMBLE}.gch"
        if _current(out, include, compiler):
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_name(out.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builds; the others find it built
            if _current(out, include, compiler):
                return out
            key_file, dep_file = out.with_name(out.name + KEY_SUFFIX), out.with_name(out.name + DEPS_SUFFIX)
            key_file.unlink(missing_ok=True)
            out.unlink(missing_ok=True)  # built from other headers: no compile may read it meanwhile
            fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".gch")
            os.close(fd)
            done = subprocess.run([compiler, *FLAGS, "-I", str(include), "-x", "c++-header", str(include / PREAMBLE),
                                   "-o", tmp, "-MD", "-MF", tmp + ".d"], capture_output=True, timeout=300)
            if done.returncode != 0:
                return None
            deps = _read_by_build(Path(tmp + ".d"), include)
            Path(tmp + ".d").unlink()
            os.chmod(tmp, 0o644)  # as MLX's own files there: readable by whoever shares the temp dir
            os.replace(tmp, out)
            tmp = None
            dep_file.write_text("\n".join(deps) + "\n")
            key_file.write_text(_key(deps, include, compiler))
        return out
    except Exception:  # a speed-up only: MLX compiles as it always did
        return None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
            Path(tmp + ".d").unlink(missing_ok=True)


@functools.cache
def prepared() -> Path | None:
    """``prepare()``, once a process."""
    return prepare()
