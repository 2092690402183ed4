"""The runs a scenario launches: its own, in an order that lets every run use what it needs, plus
the noise-floor runs its comparisons are judged against.

A comparison of run X with run B (B the reference, or X's ``compare_to``) is judged against how
far the same mathematics drifts when only its float rounding changes:

- a *twin* of B for X: B's settings in one process that computes X's N ranks' shards (each with
  X's grad_accum micro-steps) as accumulation micro-batches, summed rank by rank: X's shapes and
  X's summation order, without X's collectives, sharding code or seeds. Used for parity with the
  reference, and for a resume across world sizes. A twin is only a floor if it computes B's
  mathematics: it is probed step-locally like X, and a model whose result depends on how a batch
  is split fails there (its floor is then refused);
- a *rerun* of B: B launched again exactly as it was; used for a resume at B's world size, where
  the only difference a correct trainer may show is the device's run-to-run variation;
- a *split* run of B for X, for a trainer under test that cannot emulate ranks in one process
  (an external trainer, ``harness.scenario.trainers``): B in one process, the trainer untouched, the
  model's forward computing each batch in X's N row chunks as N ranks hold them (N ranks' shapes
  and N partial sums of each gradient; 2 chunks for a run of one process), each chunk's share of
  every parameter's gradient rounded once more in the gradient's dtype, as the ranks' all-reduce
  rounds it (``harness.rank.split_floor``). The trainer's loss and gradient are those of the whole batch,
  as in B: only their rounding differs. A trainer that computes another objective across ranks
  is not reproduced by it. Where rounding alone puts a trajectory after several steps is a
  random draw whose size varies tenfold from draw to draw (chaotic growth), and a split run
  reproduces X's rounding only in kind, not draw for draw (a twin does, nearly bitwise): so a
  split floor is ``SPLIT_SAMPLES`` such runs, each another draw of the rounding, and the floor is
  their largest deviation.

Floor runs are shared by every comparison that needs the same one. The reference runs first
(compared runs and twins read its step-local probes), then the scenario's other runs in file
order, then the floor runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.memory_plan import job_memory
from harness.scenario.job import ProbeJob, ResumeJob, TrainerRef, TrainJob
from harness.scenario.spec import DataSpec, RunSpec, Scenario, ScenarioError, compared, writes_checkpoints
from harness.scenario.trainers import TrainerInfo, heavy_libraries, trainer_info

SPLIT_SAMPLES = 3  # a split floor's draws of the rounding (``FloorRun.samples``)


@dataclass(frozen=True)
class FloorRun:
    """A run the harness adds: ``kind`` "twin" (of ``base``, emulating ``emulate`` ranks of
    ``grad_accum`` micro-steps each), "rerun" (of ``base``) or "split" (``base`` in one process,
    the model computing each batch in ``emulate`` row chunks)."""

    name: str
    kind: str
    base: str
    emulate: int = 1
    grad_accum: int = 1
    compile: str | None = None  # a twin's compile mode when it is not its base's (the compared run's)
    sample: int = 0  # which draw of a split floor's rounding (``samples``)

    def samples(self) -> list[FloorRun]:
        """The runs that make this floor: a split floor's ``SPLIT_SAMPLES`` draws of the rounding
        (``single_split2``, ``single_split2_s2``, ...), else the run itself."""
        if self.kind != "split":
            return [self]
        return [dataclasses.replace(self, name=self.name + (f"_s{k + 1}" if k else ""), sample=k)
                for k in range(SPLIT_SAMPLES)]

    def spec(self, s: Scenario) -> RunSpec:
        base = s.run(self.base)
        if self.kind == "rerun":
            return dataclasses.replace(base, name=self.name, stop_after=None, compare_to=None, expect_resume_step=None,
                                       mutation=None)
        accum = {} if self.kind == "split" else {"grad_accum": self.grad_accum}
        mode = {"compile": self.compile} if self.compile else {}
        return RunSpec(name=self.name, world_size=1, train={**base.train, **accum, **mode}, data=dict(base.data),
                       seed=base.seed)

    @property
    def description(self) -> str:
        if self.kind == "rerun":
            return f"{self.base} run again (the device's run-to-run variation)"
        if self.kind == "split":
            return (f"{self.base}'s settings in one process, the model computing each batch in {self.emulate} "
                    f"row chunks as ranks hold them; rounding draw {self.sample + 1} of {SPLIT_SAMPLES}")
        steps = f"{self.grad_accum} micro-step{'s' if self.grad_accum > 1 else ''} each"
        ranks = "1 rank's shard" if self.emulate == 1 else f"{self.emulate} ranks' shards"
        mode = {None: "", "off": ", eager", "best_effort": ", compiled"}[self.compile]
        return f"{self.base}'s settings in one process computing {ranks} ({steps}{mode})"


def _twin(s: Scenario, base: RunSpec, run: RunSpec) -> FloorRun:
    """X's twin of B; it computes with X's kernels: compiled when X compiles and B does not (and
    the other way round), since compiled and eager kernels may round differently (they do on CUDA)."""
    n, accum = run.world_size, s.for_run(run).train.grad_accum
    name = f"twin{n}" + (f"_accum{accum}" if accum > 1 else "")
    compiled = s.for_run(run).train.compile != "off"
    mode = None
    if compiled != (s.for_run(base).train.compile != "off"):
        mode, name = ("best_effort", name + "_compiled") if compiled else ("off", name + "_eager")
    if base.name != s.checks.reference:
        name += f"_of_{base.name}"
    return FloorRun(name, "twin", base.name, n, accum, mode)


def same_execution(s: Scenario, run: RunSpec, target: RunSpec) -> bool:
    """A resumed run and its target computed alike: same world size and compile mode."""
    return run.world_size == target.world_size and (
        s.for_run(run).train.compile == s.for_run(target).train.compile)


def floor_for(s: Scenario, run: RunSpec, base: RunSpec) -> FloorRun | None:
    """The floor run a comparison of ``run`` with ``base`` is judged against (None: no floors)."""
    if not s.checks.noise_floor:
        return None
    if base.name == run.compare_to and same_execution(s, run, base):
        return FloorRun(f"{base.name}_rerun", "rerun", base.name)
    if not trainer_info(s.trainer.kind).twin:
        n = max(run.world_size, 2)
        return FloorRun(f"{base.name}_split{n}", "split", base.name, n)
    return _twin(s, base, run)


def floor_runs(s: Scenario) -> list[FloorRun]:
    """Every floor run the scenario's comparisons need, once each, in a stable order."""
    found: dict[str, FloorRun] = {}
    for run in s.runs:
        if run.fails_by_design:
            continue
        bases = [s.run(s.checks.reference)] if compared(s, run) else []
        if run.compare_to is not None and not (
                s.checks.resume_tolerance is not None and same_execution(s, run, s.run(run.compare_to))):
            bases.append(s.run(run.compare_to))
        for base in bases:
            floor = floor_for(s, run, base)
            for sample in floor.samples() if floor is not None else []:
                found.setdefault(sample.name, sample)
    return list(found.values())


def spec_of(s: Scenario, name: str) -> RunSpec:
    """The spec of a declared run or of one of the scenario's floor runs."""
    for floor in floor_runs(s):
        if floor.name == name:
            return floor.spec(s)
    return s.run(name)


def launch_order(s: Scenario) -> list[RunSpec]:
    """The scenario's runs with the reference first (unless it resumes from another run)."""
    ref = s.checks.reference
    runs = list(s.runs)
    if ref is not None and s.run(ref).resume_from is None:
        runs.sort(key=lambda r: r.name != ref)
    return runs


def probe_steps(steps: int, every: int) -> list[int]:
    """The steps a parity scenario's runs are probed at: step 1 and every ``every``-th step (none
    when ``every`` is 0)."""
    if every <= 0:
        return []
    return sorted({1, *range(every, steps + 1, every)})


@dataclass(frozen=True)
class Inputs:
    """What a run's generated inputs (prose rows, a trained tokenizer) are made from: the
    scenario's ``[data]`` and seed, or the run's own where it overrides ``data``; ``key`` names
    that table in errors."""

    data: DataSpec
    seed: int
    key: str


def inputs_of(s: Scenario, run: RunSpec) -> Inputs:
    """What ``run``'s generated inputs are made from."""
    if not run.data:
        return Inputs(s.data, s.seed, "[data]")
    eff = s.for_run(run)
    return Inputs(eff.data, eff.seed, f"[[runs]][{s.runs.index(run)}].data")


def _probe(s: Scenario, run: RunSpec, floor: FloorRun | None, info: TrainerInfo) -> ProbeJob | None:
    """The reference records step-local probes; each compared run, and each twin or split floor
    run of the reference (the step-local noise floor), probes the steps it records."""
    every, ref = s.checks.probe_every, s.checks.reference
    if not every or s.kind != "parity" or ref is None or not info.probes:
        return None
    steps = tuple(probe_steps(s.for_run(run).train.steps, every))
    directory = f"{ref}/probes"
    if run.name == ref:
        return ProbeJob("record", directory, steps)
    floor_of_ref = floor is not None and floor.kind in ("twin", "split") and floor.base == ref
    if not (compared(s, run) if floor is None else floor_of_ref):
        return None
    return ProbeJob("compare" if floor is None else "floor", directory, steps)


def train_job(s: Scenario, run: RunSpec, floor: FloorRun | None = None) -> TrainJob:
    """The job every rank of one run reads: the scenario as this run sees it. A rerun gets
    its base run's faults; a twin only its base's stop requests (part of the base's plan: the
    twin must train the steps the base trained), on its one rank; a twin of the reference is
    probed like a compared run."""
    eff = s.for_run(s.run(floor.base) if floor and floor.kind == "rerun" else run)
    faults = eff.faults
    if floor and floor.kind != "rerun":
        faults = [dataclasses.replace(f, rank=0, runs=[run.name])
                  for f in s.for_run(s.run(floor.base)).faults if f.action == "stop"]
    info = trainer_info(eff.trainer.kind)
    names = [r.name for r in s.runs]
    resume = None if run.resume_from is None else ResumeJob(
        f"{run.resume_from}/checkpoints" if run.resume_from in names else run.resume_from, run.resume_step)
    return TrainJob(
        run=run.name,
        trainer=TrainerRef(info.module, info.hides, info.command, info.cpu_collectives, heavy_libraries()),
        scenario=dataclasses.replace(eff, faults=faults),
        faults=tuple(faults),
        backend=run.backend,
        stop_after=run.stop_after,
        mutation=run.mutation,
        emulate=floor.emulate if floor and floor.kind == "twin" else None,
        split_rows=floor.emulate if floor is not None and floor.kind == "split" else 0,
        split_sample=floor.sample if floor is not None else 0,
        # rank 0 keeps the parameters the run starts from: the reference's, to measure how far training moved them
        keep_start=floor is None and run.name == s.checks.reference,
        probe=_probe(s, run, floor, info),
        device={"asked": eff.train.device},  # planned at launch (``harness.controller.run_job``)
        memory=_memory(s, run),  # the budget and expected peak; ranks per host added at launch
        checkpoint_dir=f"{run.name}/checkpoints" if writes_checkpoints(s, run) else None,
        resume=resume,
        resume_in_workspace=run.resume_from in names,
    )


def _memory(s: Scenario, run: RunSpec) -> dict[str, object]:
    """``job_memory``; a bad ``MLX_DDP_HARNESS_MEMORY_BUDGET`` is a ``ScenarioError`` (one line)."""
    try:
        return job_memory(s, run)
    except ValueError as e:
        raise ScenarioError(str(e)) from e


def comparisons(s: Scenario, run: RunSpec) -> tuple[tuple[str, FloorRun | None], ...]:
    """The runs ``run`` is compared with (the reference, in a parity scenario; the run it must
    reproduce), each with the floor run that comparison is judged against."""
    if run.fails_by_design:
        return ()
    bases = [s.run(s.checks.reference)] if compared(s, run) else []
    bases += [s.run(run.compare_to)] if run.compare_to is not None else []
    return tuple((b.name, floor_for(s, run, b)) for b in bases)


def resumes_alike(s: Scenario, run: RunSpec) -> bool:
    """A resumed run computes as the run it must reproduce does (``same_execution``)."""
    return run.compare_to is not None and same_execution(s, run, s.run(run.compare_to))
