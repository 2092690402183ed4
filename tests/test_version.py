"""The version is written once (``harness.__version__``); the installed package reports it."""

from __future__ import annotations

import tomllib
from importlib import metadata

import harness
from tests.conftest import REPO


def test_the_version_has_one_source() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert metadata.version("mlx-ddp-harness") == harness.__version__
