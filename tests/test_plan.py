"""A scenario planned once: the plan's runs, checks and floors, and its typed jobs, which cross
the process boundary as JSON and come back the same, refusing what they do not know."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from harness.scenario import load_scenario
from harness.scenario.job import AllSumJob, JobError, TrainJob, job_from_json
from harness.scenario.plan import plan_scenario
from harness.scenario.runs import floor_runs, launch_order
from tests.conftest import REPO

SHIPPED = sorted((REPO / "scenarios").glob("*.toml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_scenarios_jobs_cross_as_json_and_come_back_the_same(path: Path, tmp_path: Path) -> None:
    plan = plan_scenario(load_scenario(path))
    s = plan.scenario
    assert [r.name for r in plan.runs] == [r.name for r in launch_order(s)] + [f.name for f in floor_runs(s)]
    assert [r.name for r in plan.declared] == [r.name for r in s.runs]
    for run in plan.runs:
        job = run.job.in_workspace(tmp_path).launched(world_size=run.spec.world_size, backend="ring", launched_at=1.0)
        back = job_from_json(json.loads(json.dumps(job.to_json())))
        assert isinstance(back, TrainJob) and back.to_json() == job.to_json()
        assert back.scenario.for_run(run.spec).train == run.eff.train or run.floor is not None


def test_the_plan_gives_each_compared_run_its_floor_and_each_run_its_checks() -> None:
    plan = plan_scenario(load_scenario(REPO / "examples" / "minimal_parity.toml"))
    ddp2 = plan.run("ddp2")
    assert ddp2.floor_for("single") is not None and ddp2.floor_for("single").name == "twin2"
    assert plan.run("twin2").floor is not None and plan.run("twin2").check_names == []
    assert "loss_parity" in ddp2.check_names and "loss_parity" not in plan.run("single").check_names
    assert ddp2.job.probe is not None and ddp2.job.probe.mode == "compare"
    assert plan.run("twin2").job.probe.mode == "floor"  # probed as ddp2 is, without defect hypotheses
    assert plan.run("single").job.probe.mode == "record" and plan.run("single").job.keep_start
    with pytest.raises(dataclasses.FrozenInstanceError):
        ddp2.floor = None  # type: ignore[misc]


def test_a_job_placed_in_a_workspace_probes_only_what_the_reference_recorded(tmp_path: Path) -> None:
    from harness.schema import probe_path

    plan = plan_scenario(load_scenario(REPO / "examples" / "minimal_parity.toml"))
    job = plan.run("ddp2").job
    assert job.in_workspace(tmp_path).probe is None  # nothing recorded yet: nothing to compare
    recorded = tmp_path / job.probe.dir
    recorded.mkdir(parents=True)
    probe_path(recorded, 1).write_bytes(b"")
    placed = job.in_workspace(tmp_path)
    assert placed.probe.steps == (1,) and placed.probe.dir == str(recorded)
    assert job.in_workspace(None).probe is None and job.in_workspace(None).checkpoint_dir is None


def test_a_job_file_with_an_unknown_kind_or_key_is_refused() -> None:
    with pytest.raises(JobError, match="job kind 'dance' is not one of"):
        job_from_json({"kind": "dance"})
    with pytest.raises(JobError, match="all-sum job: unknown key"):
        job_from_json({"kind": "allsum", "value": 1.0, "colour": "red"})
    job = plan_scenario(load_scenario(REPO / "examples" / "minimal_parity.toml")).run("single").job
    with pytest.raises(JobError, match="training job: unknown key.*extra"):
        job_from_json({**job.to_json(), "extra": 1})
    assert job_from_json(AllSumJob(value=2.0, rounds=3).to_json()) == AllSumJob(value=2.0, rounds=3)
