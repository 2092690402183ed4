"""The code stays ruff-clean."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def test_ruff_clean() -> None:
    ruff = Path(sys.executable).parent / "ruff"
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed (it is in the test extra)")
    p = subprocess.run([exe, "check", "harness", "tests", "benchmarks"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
