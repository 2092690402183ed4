"""Ring ranks that fill the machine's cores give a core away while they wait on a peer (Linux).

MLX's ring polls its sockets without blocking while a transfer waits (its ``SocketThread``), so
that 4 ranks on 2 cores spend most of each collective spinning on a core the awaited peer needs:
a 4-rank run of ``scenarios/streaming.toml`` took 8.2 s of training there against 2.3 s with
``ring_yield.c`` preloaded, which gives the core away on each empty poll (a yield for a wait's first
50 us, then a sleep of an eighth of the wait so far, at most 200 us) and changes nothing else. With
as many ranks as cores, the polling takes the cores the controller and any other launch need:
``scenarios/text_parity.toml`` took 25.5 s on 2 cores with every ring launch polling, 13.4 to
15.8 s with every one yielding.
The library is compiled once per source (a C compiler, ``$CC`` or ``cc``) into the user's cache;
without a compiler the ranks spin as MLX has them. ``MLX_DDP_HARNESS_RING_YIELD``: ``auto``
(default: where a ring launch puts as many ranks on one machine as it has cores, or more), ``on``
(every ring launch) or ``off``; any other value is refused. With fewer ranks than cores a polling
thread takes a core nothing else wants, and MLX is left as it is. On a cluster each host's agent
decides for the ranks placed on that host, with that host's cores and compiler
(``host_agent.op_ring_yield``). ``ACTIVE_VAR``=0 in a rank's environment switches the library off
in that rank: a warm-start server (``warm_ranks``) preloads it for every rank it forks, and each
launch's ranks say whether they yield.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

VAR = "MLX_DDP_HARNESS_RING_YIELD"
ACTIVE_VAR = "MLX_DDP_HARNESS_RING_YIELD_ACTIVE"  # read by the library (ring_yield.c) at each wait
MODES = ("auto", "on", "off")
SOURCE = Path(__file__).with_name("ring_yield.c")


@dataclass(frozen=True)
class RingYield:
    library: Path  # what the ranks preload
    why: str  # the note a run carries


def mode() -> str:
    """The user's setting (``VAR``); a value other than ``MODES`` is refused (ValueError)."""
    value = os.environ.get(VAR, "auto")
    if value not in MODES:
        raise ValueError(f"{VAR}={value!r}: use one of {', '.join(MODES)}")
    return value


def cores() -> int:
    from harness.controller.cpu_use import usable_cpus

    cpus = usable_cpus()
    return len(cpus) if cpus is not None else os.cpu_count() or 1


def _source_key() -> str:
    """The library's name for this source."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-ddp-harness"


@functools.cache
def library() -> Path | None:
    """The compiled preload library (built on first use, looked up once per process), or None
    where it cannot be built."""
    out = _cache_dir() / f"ring_yield-{_source_key()}.so"
    if not out.exists():
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            return None
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
            os.close(fd)
            done = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE), "-ldl"],
                                  capture_output=True, timeout=120)
            if done.returncode == 0:
                os.replace(tmp, out)  # atomic: concurrent launches each build, one file wins
            else:
                os.unlink(tmp)
        except (OSError, subprocess.SubprocessError):
            pass
    return out if out.exists() else None


def plan(ranks: int, backend: str | None, setting: str | None = None, world_size: int | None = None
         ) -> RingYield | None:
    """Whether ``ranks`` ring ranks on this machine, of a launch of ``world_size`` ranks (all of
    them here by default), preload the library, and the note that says so; ``setting`` is
    ``VAR``'s value (this process's own by default). Under ``on`` a host's one rank of a ring
    launch yields too: it polls as the others do."""
    setting = mode() if setting is None else setting
    world_size = ranks if world_size is None else world_size
    if setting == "off" or backend != "ring" or world_size < 2 or not sys.platform.startswith("linux"):
        return None
    n = cores()
    if setting != "on" and (ranks < n or ranks < 2):  # under auto a host's one rank polls a core of its own
        return None
    lib = library()
    if lib is None:
        return None
    why = f"{ranks} ranks on {n} cores" if ranks >= n else f"{VAR}=on"
    return RingYield(lib, f"its ranks yield a core while they wait on a peer ({why}; {VAR}=off to spin as MLX does)")


def without(preload: str) -> str:
    """An ``LD_PRELOAD`` value without this library (of any source)."""
    return os.pathsep.join(p for p in preload.split(os.pathsep) if p and not Path(p).name.startswith("ring_yield-"))


def with_library(preload: str) -> str:
    """An ``LD_PRELOAD`` value with this library first, where it can be built."""
    lib = library() if sys.platform.startswith("linux") else None
    rest = without(preload)
    return os.pathsep.join(p for p in (str(lib) if lib else "", rest) if p)
