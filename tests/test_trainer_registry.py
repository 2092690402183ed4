"""Adding a trainer is one module plus one record: a toy trainer kind, registered in this test
alone (an entry point of a package written here, as another project would ship it), runs through
validation, ``list``, ``run`` and the pytest plugin with real ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.scenario import load_scenario
from harness.scenario import trainers as trainer_registry
from harness.scenario.trainers import TrainerInfo
from tests.conftest import REPO, cli, write_scenario

TOY = '\n[trainer]\nkind = "toy"\n'


def _plugin(tmp: Path, target: str = "tests.toy_trainer:TRAINER") -> dict[str, str]:
    """A package whose one entry point line (``mlx_ddp_harness.trainers``: ``toy = target``)
    registers the toy trainer (``tests/toy_trainer.py``: its record and rank side in one module),
    on the PYTHONPATH of every process started with the returned variables."""
    site = tmp / "site"
    info = site / "toy_harness_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-harness-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{trainer_registry.ENTRY_POINTS}]\ntoy = {target}\n")
    return {"PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])}


def _toy(d: Path, name: str, world_sizes: tuple[int, ...] = (1, 2), extra: str = "") -> Path:
    path = write_scenario(d, name, world_sizes, steps=4, extra=extra)
    body = path.read_text().replace("seed = 7\n", "seed = 7\ndefault = true\n", 1)
    path.write_text(body.replace("\n[model]", TOY + "\n[model]", 1))
    return path


def test_a_kind_is_registered_once_and_a_bad_entry_point_is_one_line(tmp_path: Path) -> None:
    info = TrainerInfo("toy_here", "a toy", "tests.toy_trainer")
    try:
        trainer_registry.register(info)
        assert trainer_registry.trainer_info("toy_here") is info and "toy_here" in trainer_registry.kinds()
        with pytest.raises(ValueError, match="'toy_here' is already registered"):
            trainer_registry.register(TrainerInfo("toy_here", "another", "elsewhere"))
    finally:
        trainer_registry.unregister("toy_here")
    with pytest.raises(ValueError, match="models must be one of"):
        TrainerInfo("bad", "bad", "x", models="audio")

    env = _plugin(tmp_path, "toy_harness_plugin:INFO")
    (tmp_path / "site" / "toy_harness_plugin.py").write_text("INFO = 42\n")
    p = cli("list", str(tmp_path), env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert p.stderr.strip().splitlines()[-1].endswith("not a TrainerInfo of kind 'toy'"), p.stderr


def test_the_toy_trainer_is_validated_by_its_record(tmp_path: Path) -> None:
    env = _plugin(tmp_path)
    d = tmp_path / "suite"
    d.mkdir()
    bad = _toy(d, "toy_bad", (1, 4))  # 6 rows a step over 4 ranks: the toy's own rule
    p = cli("run", str(bad), env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "[[runs]][1].world_size: the toy trainer gives every rank the same number of rows" in p.stderr
    mutated = _toy(d, "toy_mutated", (1, 2))
    mutated.write_text(mutated.read_text() + 'mutation = "mean_of_means"\n')
    p = cli("run", str(mutated), env=env)
    assert p.returncode == 2 and "the toy trainer takes a collective mutation (allreduce_skipped" in p.stderr
    p = cli("list", str(d), env={})  # without the package: the kind is unknown, in one line
    assert p.returncode == 2 and "[trainer].kind: must be one of" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.ranks
def test_a_toy_trainer_registered_here_runs_through_list_run_and_the_pytest_plugin(tmp_path: Path) -> None:
    env = _plugin(tmp_path)
    d = tmp_path / "suite"
    d.mkdir()
    _toy(d, "toy_parity")

    listed = cli("list", str(d), env=env)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert any(line.split()[:1] == ["toy"] and "a toy trainer of the tests" in line for line in lines)

    out = tmp_path / "out"
    p = cli("run", str(d), "--out", str(out), env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((out / "result.json").read_text())
    runs = {r["name"]: r for s in doc["scenarios"] for r in s["runs"]}
    assert set(runs) >= {"single", "ddp2"}
    checks = {(c["run"], c["name"]): c for s in doc["scenarios"] for c in s["checks"]}
    step_grad = checks[("ddp2", "step_grad_parity")]
    assert step_grad["passed"] and step_grad["value"] is not None  # probed through the toy's own step
    assert checks[("ddp2", "rank0_side_effects")]["passed"]  # its record promises a save, and it saved

    plugin = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "suite", "-q"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=600,
                            env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, **env})
    assert plugin.returncode == 0, plugin.stdout + plugin.stderr
    last = plugin.stdout.strip().splitlines()[-1]  # pytest's own count, after the mlx-ddp summary
    assert " passed" in last and "failed" not in last and "1 scenario: 1 passed, 0 failed" in plugin.stdout


def test_the_registry_derives_what_the_rules_name() -> None:
    s = load_scenario(REPO / "scenarios" / "mlx_lm_parity.toml")
    assert trainer_registry.trainer_info(s.trainer.kind).resumes
    assert set(trainer_registry.with_kind("resumes")) == {"reference", "mlx_lm"}
    assert set(trainer_registry.with_kind("streams")) == {"reference", "unsloth_zoo"}
