"""What machine and software a run happened on (recorded in every result, shown by doctor)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.controller.launch import OPENBLAS, blas_preload, default_backend


def _loaded_blas() -> list[str]:
    """Shared BLAS/LAPACK libraries mapped into this process (Linux only)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    libs = {line.split()[-1] for line in maps.read_text().splitlines() if "blas" in line.lower()}
    return sorted(libs)


def blas_info() -> dict[str, Any]:
    """Which BLAS the ranks will use, and how to get a fast one when it is slow."""
    if not sys.platform.startswith("linux"):
        return {"blas": "platform (Accelerate/Metal or CUDA)", "slow": False, "fix": ""}
    import mlx.core as mx  # noqa: F401  (loads the wheel's BLAS so it shows in /proc/self/maps)

    preload = blas_preload()
    if preload:
        return {"blas": f"OpenBLAS (preloaded: {preload})", "slow": False, "fix": ""}
    bundled = ", ".join(_loaded_blas()) or "unknown"
    fix = (
        "the mlx-cpu wheel's reference BLAS is ~25x slower than OpenBLAS; install Debian's "
        "libopenblas0-pthread (apt-get install libopenblas0-pthread) and the harness preloads "
        f"{OPENBLAS} into every rank"
    )
    if os.environ.get("MLX_DDP_HARNESS_BLAS") == "bundled":
        fix = "unset MLX_DDP_HARNESS_BLAS to let the harness preload OpenBLAS"
    return {"blas": f"bundled reference BLAS ({bundled})", "slow": True, "fix": fix}


def cpu_model() -> str:
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5).stdout.strip()
        except OSError:
            pass
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def device_description() -> str:
    import mlx.core as mx

    dev = mx.default_device()
    try:
        name = mx.device_info().get("device_name", "")
    except Exception:  # device_info is not on every build
        name = ""
    return f"{dev}{f' ({name})' if name else ''}"


def git_output(path: Path, *args: str, stdin: str | None = None, timeout: float = 30) -> str | None:
    """git's output (stripped) for ``args`` in the checkout holding ``path``; None where it fails."""
    try:
        p = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=timeout,
                           input=stdin)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def git_revision(path: Path) -> str | None:
    """The short commit of the checkout holding ``path``, with ``+dirty`` when tracked files are
    modified; ``None`` outside a git checkout."""
    head = git_output(path, "rev-parse", "--short", "HEAD", timeout=5)
    if not head:
        return None
    dirty = git_output(path, "status", "--porcelain", "--untracked-files=no", timeout=10)
    return head + ("+dirty" if dirty else "")


def os_description() -> tuple[str, str]:
    """The OS name (``Linux``, ``macOS``, ...) and its full description with version."""
    if sys.platform == "darwin":
        return "macOS", f"macOS {platform.mac_ver()[0]} ({platform.machine()})"
    name = platform.system()
    return name, f"{name} {platform.release()} ({platform.machine()})"


def environment() -> dict[str, Any]:
    """What the result was measured on. ``os_name``, ``cpu`` (the chip on a Mac), ``device`` and
    ``mlx_version`` are the platform a baseline is keyed by."""
    import mlx.core as mx

    import harness

    os_name, os_full = os_description()
    return {
        "mlx_version": mx.__version__,
        "harness_version": harness.__version__,
        "device": device_description(),
        "default_backend": default_backend(),
        "os_name": os_name,
        "os": os_full,
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "blas": blas_info()["blas"],
        "git_revision": git_revision(Path(harness.__file__).parent),
    }
