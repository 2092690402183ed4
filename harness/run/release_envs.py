"""Python environments that differ from this one in one package's release, for ``gate
--bisect-versions PACKAGE==V1..V2``: the releases between two versions that the package
registries this machine reaches hold (``pip index versions``), and an environment per release,
built once and cached. Each environment is a virtual environment that sees this one's packages
(a ``.pth`` file adds this environment's site-packages after its own, as a
``--system-site-packages`` environment sees the system's) with the one release installed
over them, so building it installs that release and what it needs that differs, not the
rest. A top-level package installed there is imported from there alone: a namespace package
(``mlx``) is never merged with this environment's other release of it."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from harness.scenario import ScenarioError

VERSIONS = re.compile(r"^Available versions: (.+)$", re.M)
SPEC = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*(?:\[[A-Za-z0-9._,-]+\])?)\s*==\s*([^.\s]\S*?)\.\.(\S+)\s*")


@dataclass(frozen=True)
class Requirement:
    """``PACKAGE[EXTRAS]==V1..V2`` of ``--bisect-versions``."""

    name: str  # with its extras, as pip takes it: mlx[cpu]
    low: str
    high: str

    @property
    def package(self) -> str:
        return self.name.split("[", 1)[0]

    @classmethod
    def parse(cls, spec: str) -> Requirement:
        m = re.fullmatch(SPEC, spec)
        if not m:
            raise ScenarioError(f"--bisect-versions {spec}: give PACKAGE==V1..V2 (e.g. mlx[cpu]==0.31.0..0.32.4)")
        return cls(*m.groups())


def _version(v: str) -> object:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(v)
    except InvalidVersion as e:
        raise ScenarioError(f"{v}: not a version") from e


def pip_options(find_links: list[str], no_index: bool) -> list[str]:
    return [*(f"--find-links={d}" for d in find_links), *(["--no-index"] if no_index else [])]


def releases(req: Requirement, find_links: list[str], no_index: bool) -> list[str]:
    """The releases of ``req``'s package from its low to its high version, both included, oldest first."""
    try:
        p = subprocess.run([sys.executable, "-m", "pip", "index", "versions", req.package,
                            "--disable-pip-version-check", *pip_options(find_links, no_index)],
                           capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        raise ScenarioError(f"--bisect-versions: pip index versions {req.package} timed out after 300 s") from e
    found = VERSIONS.search(p.stdout)
    if p.returncode != 0 or not found:
        tail = (p.stderr.strip().splitlines() or ["no versions listed"])[-1]
        raise ScenarioError(f"--bisect-versions: the registries list no releases of {req.package}: {tail}")
    low, high = _version(req.low), _version(req.high)
    listed = sorted({_version(v.strip()) for v in found.group(1).split(",")})
    missing = [v for v, x in ((req.low, low), (req.high, high)) if x not in listed]
    if missing:
        raise ScenarioError(f"--bisect-versions: {req.package} {missing[0]} is not among the releases the "
                            f"registries list ({', '.join(str(v) for v in listed[-8:])}, ...)")
    if not low < high:
        raise ScenarioError(f"--bisect-versions: {req.low} is not older than {req.high}")
    return [str(v) for v in listed if low <= v <= high]


BASE_MODULE = "_mlx_ddp_harness_base"
BASE_TEXT = """\"\"\"This environment's packages, then those of the one it was built over (mlx-ddp-harness).\"\"\"
import importlib.machinery
import os
import site
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OWN = {own!r}  # top-level packages installed here: imported from here alone, never merged with the base's


class _OnlyHere:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is None and name in OWN:
            return importlib.machinery.PathFinder.find_spec(name, [HERE])
        return None


for d in {base!r}:
    site.addsitedir(d)
sys.meta_path.insert(0, _OnlyHere)
"""


def _own_packages(site: Path) -> list[str]:
    """The top-level packages and modules of every distribution installed in ``site``."""
    own = set()
    for record in site.glob("*.dist-info/RECORD"):
        for line in record.read_text().splitlines():
            top = line.split(",", 1)[0].split("/", 1)[0]
            if top and not top.endswith((".dist-info", ".data")) and top not in ("..", "__pycache__"):
                own.add(top[:-3] if top.endswith(".py") else top)
    return sorted(own - {BASE_MODULE})


def _write_base(site: Path, base: list[str], own: list[str]) -> None:
    (site / f"{BASE_MODULE}.py").write_text(BASE_TEXT.format(own=own, base=base))
    (site / f"{BASE_MODULE}.pth").write_text(f"import {BASE_MODULE}\n")


def envs_dir() -> Path:
    from harness.controller.inputs import cache_dir

    return cache_dir() / "envs"


def environment(req: Requirement, version: str, find_links: list[str], no_index: bool) -> tuple[Path | None, str]:
    """The interpreter of an environment with ``req``'s package at ``version`` over this one, built
    where it is not yet (None, and why, where it could not be built)."""
    base = list(dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]))
    what = [req.name, version, sys.version, base, find_links, no_index]
    root = envs_dir() / f"{req.package}-{version}-{hashlib.sha256(json.dumps(what).encode()).hexdigest()[:12]}"
    python = root / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    if (root / "built.json").is_file():
        return python, "cached"
    shutil.rmtree(root, ignore_errors=True)
    try:
        made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], capture_output=True,
                              text=True, timeout=300)
        if made.returncode != 0:
            return None, (made.stderr.strip().splitlines() or ["venv failed"])[-1]
        where = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, timeout=60)
        site = Path(where.stdout.strip())
        site.mkdir(parents=True, exist_ok=True)
        _write_base(site, base, [])
        p = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
                            "--only-binary=:all:", f"{req.name}=={version}", *pip_options(find_links, no_index)],
                           capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired as e:
        shutil.rmtree(root, ignore_errors=True)
        return None, f"{' '.join(map(str, e.cmd[:4]))} ... timed out after {e.timeout:g} s"
    if p.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        return None, "pip install failed: " + (p.stderr.strip().splitlines() or ["no output"])[-1]
    _write_base(site, base, _own_packages(site))
    (root / "built.json").write_text(json.dumps({"requirement": req.name, "version": version}))
    return python, "built"
