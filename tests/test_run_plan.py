"""Which floor runs a scenario launches, in what order, and the rules for injected bugs."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.scenario import ScenarioError, load_scenario
from harness.scenario.plan import job_for
from harness.scenario.runs import floor_runs, launch_order
from tests.conftest import REPO, write_scenario


def _names(name: str) -> dict[str, tuple[str, str, int, int]]:
    s = load_scenario(REPO / "scenarios" / f"{name}.toml")
    return {f.name: (f.kind, f.base, f.emulate, f.grad_accum) for f in floor_runs(s)}


def test_one_twin_per_world_size_and_accumulation() -> None:
    assert _names("text_parity") == {"twin2": ("twin", "single", 2, 1), "twin4": ("twin", "single", 4, 1)}
    assert _names("grad_accum") == {"twin2_accum2": ("twin", "single", 2, 2), "twin2_accum4": ("twin", "single", 2, 4),
                                    "twin4_accum2": ("twin", "single", 4, 2)}
    # every mutated run shares the correct run's twin
    assert _names("mutations") == {"twin2_accum2": ("twin", "single", 2, 2)}


def test_a_compiled_run_compared_with_an_eager_reference_gets_a_compiled_twin() -> None:
    """Compiled and eager kernels may round differently (on CUDA they do): the floor computes with
    the compared run's kernels."""
    assert _names("compile_modes") == {"twin2_compiled": ("twin", "eager2", 2, 1),
                                       "twin1_compiled": ("twin", "eager2", 1, 1)}
    s = load_scenario(REPO / "scenarios" / "compile_modes.toml")
    twin = next(f for f in floor_runs(s) if f.name == "twin2_compiled")
    assert twin.spec(s).train["compile"] == "best_effort" and "compiled" in twin.description


def test_resumes_get_a_rerun_of_their_target_and_parity_a_twin() -> None:
    floors = _names("resume_parity")
    assert {k: v[:2] for k, v in floors.items()} == {
        "twin1": ("twin", "full1"), "full1_rerun": ("rerun", "full1"), "twin2": ("twin", "full1"),
        "full2_rerun": ("rerun", "full2"), "twin4": ("twin", "full1"), "full4_rerun": ("rerun", "full4")}
    # across world sizes a resume is judged like parity: a twin of its target in its own shape
    assert _names("resume_validation") == {
        "full2_rerun": ("rerun", "full2", 1, 1), "twin4_of_full2": ("twin", "full2", 4, 1),
        "twin1_accum2_of_full2": ("twin", "full2", 1, 2)}


def test_an_external_trainers_floor_is_three_split_draws_per_world_size() -> None:
    s = load_scenario(REPO / "scenarios" / "mlx_lm_parity.toml")
    got = {f.name: (f.kind, f.base, f.emulate, f.sample) for f in floor_runs(s)}
    assert got == {"single_split2": ("split", "single", 2, 0), "single_split2_s2": ("split", "single", 2, 1),
                   "single_split2_s3": ("split", "single", 2, 2), "single_split4": ("split", "single", 4, 0),
                   "single_split4_s2": ("split", "single", 4, 1), "single_split4_s3": ("split", "single", 4, 2)}
    jobs = {f.name: job_for(s, f.name) for f in floor_runs(s)}
    assert [(j.split_rows, j.split_sample) for j in jobs.values()] == [(2, 0), (2, 1), (2, 2), (4, 0), (4, 1),
                                                                            (4, 2)]


def test_no_floors_for_throughput_or_when_turned_off(tmp_path: Path) -> None:
    assert _names("guide_throughput") == {}
    off = write_scenario(tmp_path, "off", checks="noise_floor = false\nloss_tolerance = 1e-5\n"
                                                 "param_tolerance = 1e-4\neval_tolerance = 1e-5")
    assert floor_runs(load_scenario(off)) == []


def test_the_reference_launches_first(tmp_path: Path) -> None:
    path = write_scenario(tmp_path, "order", world_sizes=(2, 1))
    assert [r.name for r in launch_order(load_scenario(path))] == ["single", "ddp2"]


@pytest.mark.parametrize("extra, key, message", [
    ('mutation = "sum_not_average"', "[[runs]][0].mutation", "needs world_size >= 2"),
    ('mutation = "typo"', "[[runs]][1].mutation", "must be one of"),
    ('mutation = "accum_twice"', "[[runs]][1].mutation", "accum_twice needs grad_accum >= 2"),
    ('mutation = "drop_uneven"', "[[runs]][1].mutation", "6 rows over 2 ranks do"),
])
def test_a_mutation_that_cannot_change_anything_is_refused(tmp_path: Path, extra: str, key: str,
                                                           message: str) -> None:
    path = write_scenario(tmp_path, "mut")
    text = path.read_text()
    run = 'name = "single"' if key.startswith("[[runs]][0]") else 'name = "ddp2"'
    path.write_text(text.replace(run, f"{run}\n{extra}"))
    with pytest.raises(ScenarioError) as e:
        load_scenario(path)
    assert key in str(e.value) and message in str(e.value), str(e.value)


def test_turning_floors_off_needs_absolute_limits(tmp_path: Path) -> None:
    path = write_scenario(tmp_path, "nofloor", checks="noise_floor = false")
    with pytest.raises(ScenarioError, match=r"\[checks\].noise_floor: .*set loss_tolerance, param_tolerance"):
        load_scenario(path)


def test_a_twin_stops_where_its_base_stops_and_carries_no_other_fault(tmp_path: Path) -> None:
    """early_stop: the reference stops at step 4 of 8 by request; its twin must too, on its one
    rank, or its final parameters would be four steps further (no floor for them)."""

    s = load_scenario(REPO / "scenarios" / "early_stop.toml")
    floor = next(f for f in floor_runs(s) if f.name == "twin2")
    job = job_for(s, floor.name)
    assert [(f.rank, f.step, f.action, f.phase) for f in job.faults] == [(0, 4, "stop", "step")]
    faults = ('\n[[faults]]\nrank = 1\nstep = 3\nphase = "eval"\naction = "stop"\n'
              '\n[[faults]]\nrank = 0\nstep = 2\naction = "compile_error"\n')
    mixed = load_scenario(write_scenario(tmp_path, "mixed", extra=faults))
    floor = next(f for f in floor_runs(mixed) if f.kind == "twin")
    got = job_for(mixed, floor.name).faults
    assert [(f.rank, f.step, f.action, f.phase) for f in got] == [(0, 3, "stop", "eval")]


def test_a_floor_that_trained_other_steps_is_refused() -> None:
    from harness.judge.floors import other_steps
    from tests.test_parity import _run

    base, floor = _run("single", 1, [3.0, 2.0]), _run("twin2", 1, [3.0, 2.0], floor="twin")
    assert other_steps(floor, base) is None
    floor.ranks[0].result["steps"] = 8
    assert other_steps(floor, base) == "floor refused: twin2 trained to step 8, single to step 5"
