"""A trainer whose optional package is not installed: the runs that need it are skipped, saying
so, and everything else runs (the CLI's default suite, `list`, the pytest plugin)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.scenario import load_scenario
from harness.scenario import trainers as trainer_registry
from harness.scenario.availability import runnable
from tests.conftest import REPO, cli, write_scenario

# unsloth-zoo "not installed" in every process started with it on PYTHONPATH, ranks included:
# a None entry in sys.modules is what importlib.util.find_spec reports as absent.
HIDE = "import sys\nsys.modules['unsloth_zoo'] = None\n"
UNSLOTH_RUN = '\n[[runs]]\nname = "unsloth2"\nworld_size = 2\ntrainer = {{ kind = "unsloth_zoo" }}\n'


@pytest.fixture
def no_unsloth(monkeypatch: pytest.MonkeyPatch) -> None:
    info = dataclasses.replace(trainer_registry.trainer_info("unsloth_zoo"), requires="no_such_package_for_this_test")
    monkeypatch.setitem(trainer_registry._load(), "unsloth_zoo", info)


def test_runs_of_a_missing_trainer_are_left_out_and_what_needs_them_is_skipped(no_unsloth: None) -> None:
    mixed = load_scenario(REPO / "scenarios" / "trainer_throughput.toml")
    kept, why = runnable(mixed)
    assert kept is not None and [r.name for r in kept.runs] == ["reference_1", "mlx_lm_1", "reference_2", "mlx_lm_2"]
    assert not why.whole and why.runs == ("unsloth_zoo_1", "unsloth_zoo_2")
    assert why.line().startswith("skipped trainer_throughput: runs unsloth_zoo_1, unsloth_zoo_2: "
                                 "no-such-package-for-this-test is not installed (install it with: pip install")
    kept, why = runnable(load_scenario(REPO / "scenarios" / "unsloth_parity.toml"))
    assert kept is None and why.whole and why.line().startswith("skipped unsloth_parity: ")
    text = load_scenario(REPO / "scenarios" / "text_parity.toml")
    assert runnable(text) == (text, None)


def _hidden(tmp: Path) -> dict[str, str]:
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE)
    return {"PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.ranks
def test_without_unsloth_the_suite_runs_the_rest_and_says_what_it_skipped(tmp_path: Path) -> None:
    d = tmp_path / "suite"
    d.mkdir()
    env = _hidden(tmp_path)
    mixed = write_scenario(d, "mixed", steps=2, extra=UNSLOTH_RUN.format())  # a throughput scenario
    mixed.write_text(mixed.read_text().replace("seed = 7\n", "seed = 7\ndefault = true\nkind = \"throughput\"\n", 1))
    only = write_scenario(d, "only", steps=2)  # every run trains with unsloth-zoo
    only.write_text(only.read_text().replace("seed = 7\n", "seed = 7\ndefault = true\n", 1)
                    .replace("[model]", "[trainer]\nkind = \"unsloth_zoo\"\n\n[model]", 1))
    listed = cli("list", str(d), env=env)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "default (skips unsloth2)" in listed.stdout and "default (skips all)" in listed.stdout
    assert "skipped here: unsloth-zoo is not installed (install it with: pip install --no-deps" in listed.stdout
    p = cli("run", str(d), "--out", str(tmp_path / "out"), env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "skipped mixed: runs unsloth2: unsloth-zoo is not installed" in p.stdout
    assert "skipped only: unsloth-zoo is not installed" in p.stdout
    doc = json.loads((tmp_path / "out" / "result.json").read_text())
    assert [s["name"] for s in doc["scenarios"]] == ["mixed"]
    assert [r["name"] for r in doc["scenarios"][0]["runs"] if not r.get("floor")] == ["single", "ddp2"]
    assert {(s["scenario"], s["whole"]) for s in doc["skipped"]} == {("mixed", False), ("only", True)}
    plugin = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--mlx-ddp", "-rs", "-q",
                             str(d)],
                            capture_output=True, text=True, cwd=tmp_path, timeout=600,
                            env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, **env})
    assert plugin.returncode == 0, plugin.stdout[-3000:] + plugin.stderr[-3000:]
    assert "SKIPPED" in plugin.stdout and "unsloth-zoo is not installed" in plugin.stdout
    assert " passed" in plugin.stdout.splitlines()[-1] and "failed" not in plugin.stdout.splitlines()[-1]
