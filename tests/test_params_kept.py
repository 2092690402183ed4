"""Rank 0 keeps its final parameters (and the reference its start) only where a check of the plan
reads them (``CheckFamily.reads_params``), and a one-rank run digests its start only where a
check compares runs' starts (``CheckFamily.compares_starts``): the plan's decisions, and what real
ranks and the controller then write and read."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from harness import schema
from harness.controller import run_job
from harness.scenario import checks, load_scenario
from harness.scenario.names import CheckName
from harness.scenario.plan import job_for, plan_scenario
from tests.conftest import REPO, script_scenario, write_scenario


def kept(path: Path) -> tuple[set[bool], list[str]]:
    """Whether the plan's runs keep their final parameters, and which keep their start."""
    plan = plan_scenario(load_scenario(path))
    return {r.job.keep_params for r in plan.runs}, [r.name for r in plan.runs if r.job.keep_start]


def test_only_a_plan_with_a_check_that_reads_final_parameters_keeps_them() -> None:
    assert kept(REPO / "scenarios" / "text_parity.toml") == ({True}, ["single"])  # param_parity: every run
    assert kept(REPO / "scenarios" / "resume_parity.toml")[0] == {True}  # resume_param_parity
    assert kept(REPO / "scenarios" / "guide_throughput.toml") == ({False}, [])  # no run compared
    assert kept(REPO / "scenarios" / "failure_consensus.toml") == ({False}, [])  # runs that must fail


def test_a_check_family_that_does_not_say_what_it_reads_keeps_the_parameters() -> None:
    path = REPO / "scenarios" / "guide_throughput.toml"
    family = checks.CheckFamily("peek", ("peek_params",), lambda s, spec: ["peek_params"], "tests.x:judge", "peeks")
    checks.register(family)
    try:
        assert kept(path)[0] == {True}
    finally:
        checks.unregister("peek")
    assert kept(path)[0] == {False}
    with pytest.raises(ValueError, match="not among its checks"):
        checks.CheckFamily("bad", ("a",), lambda s, spec: [], "tests.x:judge", "",
                           reads_params=(CheckName.param_parity,))


def digested(path: Path) -> dict[str, bool]:
    """Whether each run of the plan digests the parameters it starts from."""
    return {r.name: r.job.digest_start for r in plan_scenario(load_scenario(path)).runs}


def test_a_one_rank_run_digests_its_start_only_where_a_check_compares_starts() -> None:
    parity = digested(REPO / "scenarios" / "text_parity.toml")
    assert len(parity) > 2 and set(parity.values()) == {True}  # start_parity: every run, floor runs too
    assert digested(REPO / "scenarios" / "guide_throughput.toml") == {"single": False, "ddp2": True}  # its replicas
    path = REPO / "scenarios" / "trainer_throughput.toml"
    sizes = {r.name: r.spec.world_size for r in plan_scenario(load_scenario(path)).runs}
    assert digested(path) == {name: n > 1 for name, n in sizes.items()} and 1 in sizes.values()
    family = checks.CheckFamily("peek", ("peek_start",), lambda s, spec: ["peek_start"], "tests.x:judge", "peeks",
                                reads_params=())
    checks.register(family)
    try:  # a family that does not say which of its checks compare starts: every run digests its own
        assert set(digested(path).values()) == {True} and kept(path)[0] == {False}
    finally:
        checks.unregister("peek")
    with pytest.raises(ValueError, match="not among its checks"):
        checks.CheckFamily("bad", ("a",), lambda s, spec: [], "tests.x:judge", "",
                           compares_starts=(CheckName.start_parity,))


@pytest.mark.ranks
def test_real_ranks_write_and_the_controller_reads_final_parameters_only_for_a_check(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    left: list[list[str]] = []  # what each run directory held when it was removed
    remove = shutil.rmtree

    def removing(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        if Path(path).name.startswith("mlx-ddp-harness-run-"):
            left.append(sorted(str(f.relative_to(path)) for f in Path(path).rglob("*") if f.is_file()))
        remove(path, *args, **kwargs)

    monkeypatch.setattr(run_job.shutil, "rmtree", removing)
    final, start = schema.params_path(".").name, schema.start_params_path(".").name
    # mlx-lm's final parameters are the harness's copy; the reference's are its own save, always written
    for trainer, kind, keeps in (("mlx_lm", 'kind = "throughput"', False), ("reference", 'kind = "throughput"', False),
                                 ("mlx_lm", "", True)):
        path = write_scenario(tmp_path, f"{trainer}{int(keeps)}", steps=2, extra=f'\n[trainer]\nkind = "{trainer}"\n')
        path.write_text(path.read_text().replace("seed = 7\n", f"seed = 7\n{kind}\n", 1))
        out = run_job.execute("single", job_for(load_scenario(path), "single"), 1, wall_s=240, no_progress_s=120)
        assert out.ok, out.failure
        assert (out.params is not None, out.moved is not None) == (keeps, keeps)
        assert (final in left[-1], start in left[-1]) == (keeps or trainer == "reference", keeps)
        assert ("0" in out.ranks[0].result["digests"]) == keeps  # its start digested where start_parity reads it
        if keeps:  # mlx-lm's trained parameters, moved by training from the start rank 0 kept
            assert out.params and 0 < out.moved < 1
    # a script hands its final parameters to its rank in memory: no file of them, here not even the harness's
    path = script_scenario(tmp_path, (REPO / "examples" / "ddp_train.py").read_text(), world_sizes=(1, 2))
    path.write_text(path.read_text().replace("seed = 5\n", 'seed = 5\nkind = "throughput"\n', 1))
    out = run_job.execute("single", job_for(load_scenario(path), "single"), 1, wall_s=240, no_progress_s=120)
    assert out.ok, out.failure
    assert out.params is None and "model.safetensors" in left[-1]  # the script's own save, and no other
    assert [f for f in left[-1] if f.endswith(".safetensors") and f != "model.safetensors"] == []
    result = out.ranks[0].result
    assert result["final_digest"]  # the parameters handed over were digested
    assert "0" not in result["digests"] and result["dtype_changes"]["compared"] > 0  # its start: dtypes, no digest
