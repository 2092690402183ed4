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
from pathlib import Path

from harness.memory.plan import Footprint
from harness.scenario.job import ProbeJob, ResumeJob, TrainerRef, TrainJob
from harness.scenario.spec import DataSpec, RunSpec, Scenario, TrainSpec, compared
from harness.scenario.trainers import TrainerInfo, heavy_libraries, trainer_info

SPLIT_SAMPLES = 3  # a split floor's draws of the rounding (``FloorRun.samples``)


@dataclass(frozen=True)
class RunSettings:
    """A scenario's declared runs, each with its effective settings (``Scenario.for_run``:
    overrides applied, ``auto`` resolved, its own faults) worked out once, and which of them
    are compared with the reference: what every later step of the plan reads."""

    scenario: Scenario
    specs: dict[str, RunSpec]
    eff: dict[str, Scenario]
    compared: frozenset[str]

    @classmethod
    def of(cls, s: Scenario) -> RunSettings:
        return cls(s, {r.name: r for r in s.runs}, {r.name: s.for_run(r) for r in s.runs},
                   frozenset(r.name for r in s.runs if compared(s, r)))

    def run(self, name: str) -> RunSpec:
        return self.specs[name]

    def train(self, run: RunSpec) -> TrainSpec:
        return self.eff[run.name].train

    @property
    def reference(self) -> RunSpec | None:
        ref = self.scenario.checks.reference
        return None if ref is None else self.specs[ref]


def settings_of(s: Scenario | RunSettings) -> RunSettings:
    """``s``'s run settings (a scenario's worked out here; a caller holding them passes them on)."""
    return s if isinstance(s, RunSettings) else RunSettings.of(s)


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

    def train(self) -> dict[str, object]:
        """What it changes of its base's ``[train]``: a twin's accumulation, and its compile mode
        where it is not its base's (a rerun and a split run change nothing)."""
        accum = {"grad_accum": self.grad_accum} if self.kind == "twin" else {}
        return {**accum, **({"compile": self.compile} if self.compile else {})}

    def settings(self, v: RunSettings) -> Scenario:
        """The scenario as this run sees it: its base's settings with its own ``train``, the
        scenario's trainer (a rerun: its base's) and only the faults that name no run, as
        ``Scenario.for_run`` gives its ``spec``."""
        base, s = v.eff[self.base], v.scenario
        faults = [f for f in s.faults if not f.runs]
        if self.kind == "rerun":
            return dataclasses.replace(base, faults=faults)
        return dataclasses.replace(base, train=dataclasses.replace(base.train, **self.train()), trainer=s.trainer,
                                   faults=faults)

    def spec(self, s: Scenario | RunSettings) -> RunSpec:
        base = s.run(self.base)
        if self.kind == "rerun":
            return dataclasses.replace(base, name=self.name, stop_after=None, compare_to=None, expect_resume_step=None,
                                       mutation=None)
        return RunSpec(name=self.name, world_size=1, train={**base.train, **self.train()}, data=dict(base.data),
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


def _twin(v: RunSettings, base: RunSpec, run: RunSpec) -> FloorRun:
    """X's twin of B; it computes with X's kernels: compiled when X compiles and B does not (and
    the other way round), since compiled and eager kernels may round differently (they do on CUDA)."""
    n, accum = run.world_size, v.train(run).grad_accum
    name = f"twin{n}" + (f"_accum{accum}" if accum > 1 else "")
    compiled = v.train(run).compile != "off"
    mode = None
    if compiled != (v.train(base).compile != "off"):
        mode, name = ("best_effort", name + "_compiled") if compiled else ("off", name + "_eager")
    if base.name != v.scenario.checks.reference:
        name += f"_of_{base.name}"
    return FloorRun(name, "twin", base.name, n, accum, mode)


def same_execution(v: RunSettings, run: RunSpec, target: RunSpec) -> bool:
    """A resumed run and its target computed alike: same world size and compile mode."""
    return run.world_size == target.world_size and v.train(run).compile == v.train(target).compile


def floor_for(v: RunSettings, run: RunSpec, base: RunSpec) -> FloorRun | None:
    """The floor run a comparison of ``run`` with ``base`` is judged against (None: no floors)."""
    if not v.scenario.checks.noise_floor:
        return None
    if base.name == run.compare_to and same_execution(v, run, base):
        return FloorRun(f"{base.name}_rerun", "rerun", base.name)
    if not trainer_info(v.scenario.trainer.kind).twin:
        n = max(run.world_size, 2)
        return FloorRun(f"{base.name}_split{n}", "split", base.name, n)
    return _twin(v, base, run)


def _bases(v: RunSettings, run: RunSpec, floors_only: bool = False) -> list[RunSpec]:
    """The runs ``run`` is compared with: the reference (in a parity scenario) and the run it must
    reproduce; with ``floors_only``, not the latter where ``resume_tolerance`` judges it (a resume
    at its target's world size and compile mode needs no floor run then)."""
    if run.fails_by_design:
        return []
    ref = v.reference
    bases = [ref] if ref is not None and run.name in v.compared else []
    tolerated = v.scenario.checks.resume_tolerance is not None and resumes_alike(v, run)
    if run.compare_to is not None and not (floors_only and tolerated):
        bases.append(v.run(run.compare_to))
    return bases


def comparisons(v: RunSettings, run: RunSpec) -> tuple[tuple[str, FloorRun | None], ...]:
    """The runs ``run`` is compared with, each with the floor run that comparison is judged
    against."""
    return tuple((b.name, floor_for(v, run, b)) for b in _bases(v, run))


def floor_runs(s: Scenario | RunSettings) -> list[FloorRun]:
    """Every floor run the scenario's comparisons need, once each, in a stable order."""
    v = settings_of(s)
    found: dict[str, FloorRun] = {}
    for run in v.specs.values():
        for base in _bases(v, run, floors_only=True):
            floor = floor_for(v, run, base)
            for sample in floor.samples() if floor is not None else []:
                found.setdefault(sample.name, sample)
    return list(found.values())


def resumes_alike(v: RunSettings, run: RunSpec) -> bool:
    """A resumed run computes as the run it must reproduce does (``same_execution``)."""
    return run.compare_to is not None and same_execution(v, run, v.run(run.compare_to))


def launch_order(s: Scenario | RunSettings) -> list[RunSpec]:
    """The scenario's runs with the reference first (unless it resumes from another run)."""
    v = settings_of(s)
    ref, runs = v.reference, list(v.specs.values())
    if ref is not None and ref.resume_from is None:
        runs.sort(key=lambda r: r.name != ref.name)
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


def inputs_of(v: RunSettings, run: RunSpec) -> Inputs:
    """What ``run``'s generated inputs are made from."""
    s = v.scenario
    if not run.data:
        return Inputs(s.data, s.seed, "[data]")
    eff = v.eff[run.name]
    return Inputs(eff.data, eff.seed, f"[[runs]][{s.runs.index(run)}].data")


def _probe(v: RunSettings, run: RunSpec, floor: FloorRun | None, steps: int, info: TrainerInfo) -> ProbeJob | None:
    """The reference records step-local probes; each compared run, and each twin or split floor
    run of the reference (the step-local noise floor), probes the steps it records."""
    s = v.scenario
    every, ref = s.checks.probe_every, s.checks.reference
    if not every or s.kind != "parity" or ref is None or not info.probes:
        return None
    at = tuple(probe_steps(steps, every))
    directory = f"{ref}/probes"
    if run.name == ref:
        return ProbeJob("record", directory, at)
    floor_of_ref = floor is not None and floor.kind in ("twin", "split") and floor.base == ref
    if not (run.name in v.compared if floor is None else floor_of_ref):
        return None
    return ProbeJob("compare" if floor is None else "floor", directory, at)


def train_job(v: RunSettings, run: RunSpec, eff: Scenario, memory: dict[str, object],
              floor: FloorRun | None = None, keep_params: bool = True, starts_compared: bool = True) -> TrainJob:
    """The job every rank of one run reads: ``eff``, the scenario as this run sees it. A rerun
    gets its base run's faults; a twin only its base's stop requests (part of the base's plan: the
    twin must train the steps the base trained), on its one rank; a twin of the reference is
    probed like a compared run. ``memory``: what its job says of memory
    (``harness.memory.plan.job_memory``). ``keep_params``: whether a check reads final parameters;
    ``starts_compared``: whether a check compares runs' starts."""
    base = v.eff[floor.base] if floor is not None else eff
    if floor is not None and floor.kind == "rerun":
        eff = base
    faults = eff.faults
    if floor is not None and floor.kind != "rerun":
        faults = [dataclasses.replace(f, rank=0, runs=[run.name]) for f in base.faults if f.action == "stop"]
    info = trainer_info(eff.trainer.kind)
    resume = None if run.resume_from is None else ResumeJob(
        f"{run.resume_from}/checkpoints" if run.resume_from in v.specs else run.resume_from, run.resume_step)
    probe = _probe(v, run, floor, eff.train.steps, info)
    return TrainJob(
        run=run.name,
        scenario=dataclasses.replace(eff, faults=faults),
        faults=tuple(faults),
        backend=run.backend,
        stop_after=run.stop_after,
        mutation=run.mutation,
        emulate=floor.emulate if floor and floor.kind == "twin" else None,
        split_rows=floor.emulate if floor is not None and floor.kind == "split" else 0,
        split_sample=floor.sample if floor is not None else 0,
        # rank 0 keeps the parameters the run starts from: the reference's, to measure how far training moved them
        keep_start=keep_params and floor is None and run.name == v.scenario.checks.reference,
        keep_params=keep_params,
        digest_start=starts_compared or run.world_size > 1,  # more ranks: replica consistency compares theirs
        probe=probe,
        device={"asked": eff.train.device},  # planned at launch (``harness.controller.run_job``)
        checkpoint_dir=f"{run.name}/checkpoints" if run.writes_checkpoints(eff.train) else None,
        resume=resume,
        resume_in_workspace=run.resume_from in v.specs,
        trainer=TrainerRef(info.module, info.hides, info.command, info.cpu_collectives, heavy_libraries()),
        memory=memory,  # the budget and expected peak; ranks per host added at launch
    )


def footprint(eff: Scenario) -> Footprint:
    """What the memory plan reads of a run's effective settings (``harness.memory.plan``)."""
    c, model = eff.checks, eff.model
    ceilings = tuple((v, k) for v, k in ((c.max_mlx_mb, "max_mlx_mb"), (c.max_rss_mb, "max_rss_mb")) if v is not None)
    return Footprint(ceilings, model.arch, model.vision, model.path, dict(model.config), model.built_dtype,
                     eff.data.tokenizer, None if eff.path is None else str(Path(eff.path).parent),
                     eff.trainer.fine_tune == "lora", eff.limits.memory_budget_mb)

