"""No check passes without power, for a user's own script (examples/minimal_script.py), with real
ranks: a script that never seeds its model (each rank and each run draws its own weights), one
that broadcasts rank 0's unseeded weights (the ranks agree, the runs do not) and one that never
says where training starts all fail, the first two with the "different weights" line; the
correct script passes, its global RNGs judged from the start of training, not its model's build;
a script whose training draws from numpy's global RNG fails, the RNG named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, cli

EXAMPLE = REPO / "examples" / "minimal_script.py"
SEED = "    mx.random.seed(run.seed)  # the same weights on every rank and in every run\n"
SPLIT = "    model = run.split(MLP(vocab))  # 3. training starts from these weights\n"
BROADCAST = ("    model = MLP(vocab)\n"
             "    model.update(tree_map(lambda p: mx.distributed.all_sum(p if rank == 0 else mx.zeros_like(p),\n"
             "                                                           group=group), model.parameters()))\n"
             "    model = run.split(model)  # rank 0's weights on every rank\n")
DIFFERENT = "runs start from different weights: seed the model"


def variant(*edits: tuple[str, str]) -> str:
    src = EXAMPLE.read_text()
    for old, new in edits:
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    return src


def judged(tmp_path: Path, script: str, rc: int) -> dict[tuple[str, str], dict[str, Any]]:
    """Run ``script`` as the minimal example's scenario (1 process vs 2 ranks); its checks by (name, run)."""
    (tmp_path / "minimal_script.py").write_text(script)
    toml = (REPO / "examples" / "minimal_script.toml").read_text().replace("steps = 10", "steps = 6")
    (tmp_path / "s.toml").write_text(toml)
    p = cli("run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"))
    assert p.returncode == rc, p.stdout[-4000:] + p.stderr[-2000:]
    doc = json.loads((tmp_path / "o" / "result.json").read_text())
    return {(c["name"], c["run"]): c for c in doc["scenarios"][0]["checks"]}


@pytest.mark.ranks
def test_the_correct_script_passes_with_its_rng_judged_from_the_start_of_training(tmp_path: Path) -> None:
    checks = judged(tmp_path, EXAMPLE.read_text(), 0)
    assert checks[("start_parity", "ddp2")]["result"] == "pass"
    assert "equal to single's" in checks[("start_parity", "ddp2")]["detail"]
    for name in ("loss_parity", "param_parity", "lr_schedule"):
        assert checks[(name, "ddp2")]["result"] == "pass", checks[(name, "ddp2")]
    # mx.random.seed and the model's build moved MLX's global RNG before training started
    assert checks[("global_rng_untouched", "single")]["result"] == "pass"
    assert checks[("global_rng_untouched", "ddp2")]["result"] == "pass"
    scenario = json.loads((tmp_path / "o" / "result.json").read_text())["scenarios"][0]
    assert scenario["model"].startswith("the script's own model 0.0"), scenario["model"]  # its MLP, not qwen3


@pytest.mark.ranks
def test_an_unseeded_script_fails_with_the_different_weights_line(tmp_path: Path) -> None:
    checks = judged(tmp_path, variant((SEED, "")), 1)
    start = checks[("start_parity", "ddp2")]
    assert start["result"] == "FAIL" and DIFFERENT in start["detail"], start
    assert "ddp2 rank 0" in start["detail"] and "ddp2 rank 1" in start["detail"]
    for name in ("loss_parity", "param_parity"):  # never a pass: the floor runs drew their own weights too
        c = checks[(name, "ddp2")]
        assert c["result"] == "FAIL" and c["detail"].startswith("no power"), c
    # replica_consistency is not asserted: MLX seeds an unseeded RNG from the clock, so two ranks
    # started in the same tick may draw the same weights (runs seconds apart never do)


@pytest.mark.ranks
def test_broadcasting_rank0s_unseeded_weights_is_no_pass(tmp_path: Path) -> None:
    """The ranks agree (replica consistency passes) but the 2-rank run trains other weights than
    the one process: the start check names it and no trajectory check passes."""
    checks = judged(tmp_path, variant((SEED, ""), (SPLIT, BROADCAST)), 1)
    assert checks[("replica_consistency", "ddp2")]["result"] == "pass"
    start = checks[("start_parity", "ddp2")]
    assert start["result"] == "FAIL" and DIFFERENT in start["detail"], start
    param = checks[("param_parity", "ddp2")]
    assert param["result"] == "FAIL" and param["detail"].startswith("no power"), param


@pytest.mark.ranks
def test_a_limit_as_large_as_training_itself_is_no_power(tmp_path: Path) -> None:
    """A script that never says where training starts (no run.split / run.start) and never
    seeds: the start cannot be compared (n/a), but the floor runs differ from the reference as
    much as anything, and the parameter limit that makes is reported as no power: a failure, not
    INCONCLUSIVE, since the runs may not start alike."""
    checks = judged(tmp_path, variant((SEED, ""), (SPLIT, "    model = MLP(vocab)\n")), 1)
    assert checks[("start_parity", "ddp2")]["result"] == "n/a"
    assert "never said what training starts from" in checks[("start_parity", "ddp2")]["detail"]
    param = checks[("param_parity", "ddp2")]
    assert param["result"] == "FAIL" and param["detail"].startswith("no power: the floor runs "), param
    assert "so the runs may not start alike either" in param["detail"], param
    assert param["limit"] >= 1.0
    assert checks[("global_rng_untouched", "ddp2")]["result"] == "n/a"


@pytest.mark.ranks
def test_training_that_draws_from_numpys_global_rng_is_named(tmp_path: Path) -> None:
    mine = "        mine = picked[rank::size]  # this rank's share of the global batch\n"
    checks = judged(tmp_path, variant((mine, mine + "        np.random.shuffle(mine)  # numpy's global RNG\n")), 1)
    c = checks[("global_rng_untouched", "ddp2")]
    assert c["result"] == "FAIL", c
    assert "rank 0: numpy" in c["detail"] and "np.random.default_rng(seed)" in c["detail"], c
    assert "mlx" not in c["detail"].split(";")[0], c


@pytest.mark.ranks
def test_a_script_that_never_uses_the_api_stops_after_its_first_run(tmp_path: Path) -> None:
    """It reports no steps in the first run; every other run would say the same, so none is launched."""
    (tmp_path / "minimal_script.py").write_text("print('training')\n")
    (tmp_path / "s.toml").write_text((REPO / "examples" / "minimal_script.toml").read_text())
    p = cli("run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"))
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-2000:]
    line = ("trainer script minimal_script.py reported no steps (it never called harness.api.session(): "
            "see docs/scripts.md)")
    assert line in p.stdout, p.stdout[-3000:]
    runs = {r["name"]: r for r in json.loads((tmp_path / "o" / "result.json").read_text())["scenarios"][0]["runs"]}
    assert not (tmp_path / "o" / "runs" / "minimal_script" / "ddp2").exists()  # never launched
    assert set(runs) >= {"single", "ddp2"} and not runs["ddp2"]["ok"]
    assert "not run: run 'single'" in runs["ddp2"]["failure"], runs["ddp2"]


@pytest.mark.ranks
def test_saying_where_training_starts_after_a_step_is_refused(tmp_path: Path) -> None:
    """A start reported after step 1 would hide the global RNG's use in step 1 and replace the
    start compared: the run fails with one line naming the script."""
    after = "                 lr=optimizer.learning_rate.item(), params=model.parameters())\n"
    (tmp_path / "minimal_script.py").write_text(variant((after, after + "        run.start(model.parameters())\n")))
    (tmp_path / "s.toml").write_text((REPO / "examples" / "minimal_script.toml").read_text())
    p = cli("run", str(tmp_path / "s.toml"))
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-2000:]
    assert ("trainer script minimal_script.py said where training starts after step 1: run.split and run.start "
            "come before the first step") in p.stdout, p.stdout[-3000:]
