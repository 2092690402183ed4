"""MLX's CPU kernels compile against the precompiled preamble the controller puts into MLX's
kernel cache (``harness/controller/kernel_cache.py``): a scenario's ranks find it there, GCC
takes it for MLX's own compile command, and it is rebuilt when what it was built from changes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.controller import kernel_cache
from tests.conftest import REPO, cli

needs_gcc = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("g++") is None,
                               reason="MLX compiles CPU kernels with g++ on Linux; none here")


def _mlx_compile_uses(source: Path) -> str:
    """The first header GCC reads for ``source`` under MLX's own kernel compile command (``-H``
    names each: a precompiled one it uses is marked ``!``)."""
    include = kernel_cache.include_dir()
    p = subprocess.run(["g++", *kernel_cache.FLAGS, "-shared", "-I", str(include), "-H", str(source),
                        "-o", str(source.with_suffix(".test.so"))], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stderr.splitlines()[0]


@needs_gcc
@pytest.mark.ranks
@pytest.mark.mlx_ddp_world_size(2)
def test_a_runs_ranks_compile_their_kernels_against_the_precompiled_preamble(tmp_path: Path) -> None:
    temp, bin_dir, log = tmp_path / "temp", tmp_path / "bin", tmp_path / "headers.log"
    temp.mkdir()
    bin_dir.mkdir()
    shim = bin_dir / "g++"  # the g++ MLX runs (through the shell, as it finds it), logging what each compile read
    shim.write_text(f'#!/bin/sh\nerr=$(mktemp)\n{shutil.which("g++")} -H "$@" 2>"$err"; rc=$?\n'
                    f'cat "$err" >>"{log}"; cat "$err" >&2; rm -f "$err"; exit $rc\n')
    shim.chmod(0o755)
    text = (REPO / "examples" / "minimal_parity.toml").read_text()
    assert "steps = 10\n" in text
    scenario = tmp_path / "compiled.toml"  # its steps compiled: MLX compiles their kernels' sources
    scenario.write_text(text.replace("steps = 10\n", 'steps = 3\ncompile = "strict"\n'))
    p = cli("run", str(scenario), "--out", str(tmp_path / "out"),
            env={"TMPDIR": str(temp), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    cache = kernel_cache.cache_dir(str(temp))
    pch = cache / f"{kernel_cache.PREAMBLE}.gch"
    assert pch.is_file() and list(cache.glob("lib*.so"))  # the ranks' MLX compiled kernels there
    read = log.read_text().splitlines()
    used = [line for line in read if line == f"! {pch}"]
    parsed = [line for line in read if line.endswith(f" {kernel_cache.include_dir() / kernel_cache.PREAMBLE}")]
    assert len(used) >= len(list(cache.glob("lib*.so"))), read[:5]  # every kernel compile took it (some twice)
    assert parsed == [], parsed  # no kernel compile parsed the preamble itself


@needs_gcc
def test_the_preamble_is_built_once_and_again_when_what_it_was_built_from_changes(tmp_path: Path) -> None:
    cache = tmp_path / "cpu"
    pch = kernel_cache.prepare(cache)
    assert pch == cache / f"{kernel_cache.PREAMBLE}.gch" and pch.is_file()
    built = pch.stat().st_mtime_ns
    assert kernel_cache.prepare(cache) == pch and pch.stat().st_mtime_ns == built  # current: left as it is
    key = pch.with_name(pch.name + kernel_cache.KEY_SUFFIX)
    key.write_text("other headers")
    assert kernel_cache.prepare(cache) == pch and pch.stat().st_mtime_ns != built
    assert key.read_text() != "other headers"
    # a kernel source beside it compiles against it, as MLX's do in its cache
    kernel = cache / "kernel.cpp"
    kernel.write_text('#include "mlx/backend/cpu/compiled_preamble.h"\nextern "C" void k() {}\n')
    assert _mlx_compile_uses(kernel) == f"! {pch}"


def test_without_gcc_nothing_is_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert kernel_cache.prepare(tmp_path / "cpu") is None and not (tmp_path / "cpu").exists()
