"""A scenario planned once, before anything runs: every run it launches (its own in launch
order, then the floor runs its comparisons need), each run's typed job, the steps it is probed
at, the checks it is judged by (``harness.scenario.checks``) and the floor run each comparison is
judged against (``harness.scenario.runs``). The controller launches the plan's runs, the judge
judges its checks and the report reads its runs; none works any of it out again."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.memory.plan import Footprint, job_memory
from harness.scenario.checks import CheckFamily, run_rules
from harness.scenario.job import TrainJob
from harness.scenario.runs import (
    FloorRun,
    Inputs,
    RunSettings,
    comparisons,
    floor_runs,
    footprint,
    inputs_of,
    launch_order,
    resumes_alike,
    train_job,
)
from harness.scenario.spec import RunSpec, Scenario, ScenarioError
from harness.scenario.trainers import TrainerInfo, trainer_info


@dataclass(frozen=True)
class PlannedRun:
    """One run: its spec (a floor run's made from its base's), the scenario as it sees it, its
    trainer's record, what its generated inputs are made from, its memory footprint and typed
    job; for a run of the scenario, the checks each rule gives it and the floor run each
    comparison needs (by the compared-with run's name); for a floor run, what it is (``floor``)."""

    spec: RunSpec
    eff: Scenario
    trainer: TrainerInfo
    floor: FloorRun | None
    checks: tuple[tuple[CheckFamily, tuple[str, ...]], ...]
    floors: tuple[tuple[str, FloorRun | None], ...]
    resumes_alike: bool  # resumed at its target's world size and compile mode
    inputs: Inputs
    footprint: Footprint  # what its memory is estimated from (``harness.memory.plan``)
    job: TrainJob

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def check_names(self) -> list[str]:
        return [n for _, names in self.checks for n in names]

    def floor_for(self, base: str) -> FloorRun | None:
        """The floor run this run's comparison with run ``base`` is judged against."""
        return dict(self.floors).get(base)


@dataclass(frozen=True)
class ScenarioPlan:
    """A scenario's runs in launch order (floor runs last) and the scenario they came from."""

    scenario: Scenario
    runs: tuple[PlannedRun, ...]

    def run(self, name: str) -> PlannedRun:
        for r in self.runs:
            if r.name == name:
                return r
        raise KeyError(name)

    @property
    def declared(self) -> list[PlannedRun]:
        """The scenario's own runs, in file order."""
        return [self.run(r.name) for r in self.scenario.runs]

    @property
    def floor_runs(self) -> list[PlannedRun]:
        return [r for r in self.runs if r.floor is not None]

    def checks(self) -> dict[str, list[str]]:
        """Each judged run's checks by name, in file order (what a test collector lists)."""
        return {r.name: r.check_names for r in self.declared}


def plan_scenario(s: Scenario) -> ScenarioPlan:
    """The plan of a loaded scenario (pure: it reads no file and starts nothing), in one pass:
    each run's checks (``harness.scenario.checks``), effective settings (``RunSettings``), floor
    runs, comparisons, inputs, memory footprint and typed job (``harness.scenario.runs``). Rank 0
    of each run keeps its final parameters for the judge only where a check of the plan reads
    them (``CheckFamily.reads_params``), and a one-rank run digests its start only where a check
    of the plan compares runs' starts (``CheckFamily.compares_starts``)."""
    rules = {spec.name: tuple((rule, tuple(names)) for rule, names in run_rules(s, spec)) for spec in s.runs}
    given = [(rule, names) for of_run in rules.values() for rule, names in of_run]
    # such checks compare runs (and their floor runs): all keep what they read, or none
    keep_params = any(rule.reads_params_in(names) for rule, names in given)
    starts_compared = any(rule.compares_starts_in(names) for rule, names in given)
    v = RunSettings.of(s)
    floors = floor_runs(v)
    runs = [(spec, None) for spec in launch_order(v)] + [(f.spec(v), f) for f in floors]
    eff = {**v.eff, **{f.name: f.settings(v) for f in floors}}
    planned = []
    for spec, floor in runs:
        own = eff[spec.name]
        judged = floor is None
        fp = footprint(own)
        compared_with = comparisons(v, spec) if judged else ()
        alike = judged and resumes_alike(v, spec)
        inputs = inputs_of(v, v.run(floor.base) if floor else spec)
        try:
            memory = job_memory(fp)
        except ValueError as e:  # a bad MLX_DDP_HARNESS_MEMORY_BUDGET
            raise ScenarioError(str(e)) from e
        job = train_job(v, spec, own, memory, floor, keep_params, starts_compared)
        planned.append(PlannedRun(spec, own, trainer_info(own.trainer.kind), floor, rules.get(spec.name, ()),
                                  compared_with, alike, inputs, fp, job))
    return ScenarioPlan(s, tuple(planned))


def job_for(s: Scenario, run: str, workspace: Path | None = None) -> TrainJob:
    """The job of one run of ``s`` (a declared run or a floor run), placed in ``workspace``."""
    return plan_scenario(s).run(run).job.in_workspace(workspace)
