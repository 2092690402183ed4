"""The jobs a controller gives its ranks, typed: what one run's ranks do (``TrainJob``), the
launch check's all-sums (``AllSumJob``), the speed anchor's bare step (``AnchorJob``) and the
hang-rate soak's gradient-shaped all-reduces (``SoakJob``).

A job crosses the process boundary as the job file (``harness.schema.JOB_FILE``): ``to_json``
writes it and ``job_from_json`` reads it back strictly, refusing a key it does not know. A
training job is planned with the scenario (``harness.scenario.plan``), its directories relative
to the scenario's workspace; the controller places it in a workspace (``in_workspace``) and adds
what only the launch knows (``launched``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.scenario.spec import FaultSpec, ModelSpec, Scenario


class JobError(ValueError):
    """A job file that is not a job of this harness's version (an unknown kind or key)."""


TRAIN_KEYS = {"run", "trainer", "scenario", "faults", "backend", "stop_after", "mutation", "emulate", "split_rows",
              "split_sample", "keep_start", "keep_params", "digest_start", "probe", "device", "memory",
              "checkpoint_dir", "resume", "world_size", "launched_at"}


def _known(d: dict[str, Any], known: set[str], what: str) -> None:
    unknown = set(d) - known - {"kind", "schema_version"}
    if unknown:
        raise JobError(f"{what}: unknown key(s) {', '.join(sorted(unknown))}")


@dataclass(frozen=True)
class TrainerRef:
    """The trainer the ranks import: its rank module, the libraries to mark absent first,
    whether the trainer joins the distributed group itself (an executable), why it
    all-reduces on MLX's CPU stream (which picks the backend on CUDA; None: on the device), and
    the libraries whose import costs seconds, which the rank reports as loaded or not (planned
    from the trainer registry, which a rank does not load: its entry points cost a scan)."""

    module: str
    hides: tuple[str, ...] = ()
    own_group: bool = False
    cpu_collectives: str | None = None
    heavy: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProbeJob:
    """Step-local probes: the reference records them (``mode`` "record") at ``steps``, a compared
    run computes them there (``compare``), with the known defects' hypotheses that name a failed
    check's defect, and a floor run of the reference computes them without those (``floor``: no
    check of its is judged, so nothing would read them); ``dir`` is where."""

    mode: str
    dir: str
    steps: tuple[int, ...]


@dataclass(frozen=True)
class ResumeJob:
    """The checkpoints a run resumes from (``source``) and which step's (None: the newest)."""

    source: str
    step: int | None = None


@dataclass(frozen=True)
class TrainJob:
    """What every rank of one run reads: the scenario as this run sees it (``scenario``, its
    faults those the run takes), and how the harness runs it. ``emulate``: a twin's ranks
    emulated in one process; ``split_rows`` / ``split_sample``: a split floor run's row chunks
    and draw; ``keep_start``: rank 0 keeps the parameters it starts from (the reference's);
    ``keep_params``: rank 0 keeps its final parameters, and the controller reads them, for a check
    that compares them (without one, a trainer's own saves are all it writes); ``digest_start``:
    each rank digests the parameters training starts from (the replica digest before the first
    step), for the checks that compare them.
    ``device``: asked, then planned at launch; ``memory``: the budget and expected peak, ranks
    per host added at launch. ``world_size``, ``backend`` and ``launched_at`` are the launch's."""

    run: str
    trainer: TrainerRef
    scenario: Scenario
    faults: tuple[FaultSpec, ...] = ()
    backend: str | None = None
    stop_after: int | None = None
    mutation: str | None = None
    emulate: int | None = None
    split_rows: int = 0
    split_sample: int = 0
    keep_start: bool = False
    keep_params: bool = True
    digest_start: bool = True
    probe: ProbeJob | None = None
    device: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    checkpoint_dir: str | None = None
    resume: ResumeJob | None = None
    resume_in_workspace: bool = False  # ``resume.source`` is an earlier run's, in the workspace
    world_size: int | None = None
    launched_at: float | None = None

    kind = "train"

    @property
    def steps(self) -> int:
        """The steps the run trains (its stop, else the scenario's)."""
        return int(self.stop_after or self.scenario.train.steps)

    def in_workspace(self, workspace: Path | None) -> TrainJob:
        """The job with its directories in ``workspace``; a compared run probes only the steps
        the reference recorded there. Without one (a job run alone), it neither probes nor
        checkpoints, and cannot resume from an earlier run."""
        if workspace is None:
            if self.resume_in_workspace:
                raise ValueError(f"run {self.run!r} resumes from an earlier run: a workspace is needed")
            return dataclasses.replace(self, probe=None, checkpoint_dir=None)
        probe = self.probe
        if probe is not None:
            directory = workspace / probe.dir
            steps = probe.steps
            if probe.mode != "record":
                from harness.schema import probe_path

                steps = tuple(k for k in steps if probe_path(directory, k).exists())
            probe = dataclasses.replace(probe, dir=str(directory), steps=steps) if steps else None
        resume = self.resume
        if resume is not None and self.resume_in_workspace:
            resume = dataclasses.replace(resume, source=str(workspace / resume.source))
        ckpt = str(workspace / self.checkpoint_dir) if self.checkpoint_dir else None
        return dataclasses.replace(self, probe=probe, resume=resume, checkpoint_dir=ckpt, resume_in_workspace=False)

    def launched(self, **launch: Any) -> TrainJob:
        return dataclasses.replace(self, **launch)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "run": self.run,
            "trainer": {"module": self.trainer.module, "hides": list(self.trainer.hides),
                        "own_group": self.trainer.own_group, "cpu_collectives": self.trainer.cpu_collectives,
                        "heavy": list(self.trainer.heavy)},
            "scenario": dataclasses.replace(self.scenario, faults=list(self.faults)).to_dict(),
            "backend": self.backend,
            "faults": [dataclasses.asdict(f) for f in self.faults],
            "stop_after": self.stop_after,
            "mutation": self.mutation,
            "emulate": self.emulate,
            "split_rows": self.split_rows,
            "split_sample": self.split_sample,
            "keep_start": self.keep_start,
            "keep_params": self.keep_params,
            "digest_start": self.digest_start,
            "probe": None if self.probe is None else {"mode": self.probe.mode, "dir": self.probe.dir,
                                                      "steps": list(self.probe.steps)},
            "device": dict(self.device),
            "memory": dict(self.memory),
        }
        if self.checkpoint_dir is not None:
            out["checkpoint_dir"] = self.checkpoint_dir
        if self.resume is not None:
            out["resume"] = {"from": self.resume.source, "step": self.resume.step}
        for key in ("world_size", "launched_at"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainJob:
        _known(d, TRAIN_KEYS, "training job")
        probe, resume = d.get("probe"), d.get("resume")
        return cls(
            run=d["run"],
            trainer=TrainerRef(d["trainer"]["module"], tuple(d["trainer"].get("hides", ())),
                               bool(d["trainer"].get("own_group", False)), d["trainer"].get("cpu_collectives"),
                               tuple(d["trainer"].get("heavy", ()))),
            scenario=Scenario.from_dict(d["scenario"]),
            faults=tuple(FaultSpec(**f) for f in d.get("faults", ())),
            backend=d.get("backend"),
            stop_after=d.get("stop_after"),
            mutation=d.get("mutation"),
            emulate=d.get("emulate"),
            split_rows=int(d.get("split_rows") or 0),
            split_sample=int(d.get("split_sample") or 0),
            keep_start=bool(d.get("keep_start")),
            keep_params=bool(d.get("keep_params", True)),
            digest_start=bool(d.get("digest_start", True)),
            probe=None if probe is None else ProbeJob(probe["mode"], probe["dir"], tuple(probe["steps"])),
            device=dict(d.get("device") or {}),
            memory=dict(d.get("memory") or {}),
            checkpoint_dir=d.get("checkpoint_dir"),
            resume=None if resume is None else ResumeJob(resume["from"], resume.get("step")),
            world_size=d.get("world_size"),
            launched_at=d.get("launched_at"),
        )


@dataclass(frozen=True)
class AllSumJob:
    """``rounds`` all-sums of ``value`` (``elems`` elements each), ``pause_s`` apart: the check
    that a launch's ranks reach each other, and what the launch benchmarks time."""

    value: float = 1.0
    rounds: int = 1
    pause_s: float = 0.0
    elems: int | None = None
    faults: tuple[FaultSpec, ...] = ()  # a rank misbehaving between all-sums
    ops: tuple[str, ...] = ()  # instead: each of these collectives tried once (``harness.rank.collective_probe``)
    world_size: int | None = None
    backend: str | None = None
    launched_at: float | None = None
    device: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)

    kind = "allsum"
    scenario = None
    steps = 0

    def launched(self, **launch: Any) -> AllSumJob:
        return dataclasses.replace(self, **launch)

    def to_json(self) -> dict[str, Any]:
        out = {"kind": self.kind, **{k: v for k, v in dataclasses.asdict(self).items() if v is not None}}
        out["faults"] = [dataclasses.asdict(f) for f in self.faults]
        out["ops"] = list(self.ops)
        return {k: v for k, v in out.items() if v != {} and (k != "ops" or v)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AllSumJob:
        known = {f.name for f in dataclasses.fields(cls)}
        _known(d, known, "all-sum job")
        return cls(**{k: tuple(FaultSpec(**f) for f in v) if k == "faults" else tuple(v) if k == "ops" else v
                      for k, v in d.items() if k in known})


@dataclass(frozen=True)
class AnchorJob:
    """The speed anchor: mlx-lm's bare training step on the scenario's model and rows
    (``kind`` "mlx_lm_step"), or its gradient all-reduce alone ("grad_allreduce"), timed
    ``repeats`` times beside the trainers it anchors."""

    scenario: Scenario
    repeats: int | None = None
    kind: str = "mlx_lm_step"
    faults = ()
    world_size: int | None = None
    backend: str | None = None
    launched_at: float | None = None
    device: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return self.scenario.train.steps

    def launched(self, **launch: Any) -> AnchorJob:
        return dataclasses.replace(self, **launch)

    def to_json(self) -> dict[str, Any]:
        out = {"kind": self.kind, "scenario": self.scenario.to_dict(), "repeats": self.repeats,
               "world_size": self.world_size, "backend": self.backend, "launched_at": self.launched_at,
               "device": self.device, "memory": self.memory}
        return {k: v for k, v in out.items() if v is not None and v != {}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AnchorJob:
        _known(d, {f.name for f in dataclasses.fields(cls)}, "speed-anchor job")
        return cls(Scenario.from_dict(d["scenario"]), d.get("repeats"), d["kind"], d.get("world_size"),
                   d.get("backend"), d.get("launched_at"), dict(d.get("device") or {}), dict(d.get("memory") or {}))


@dataclass(frozen=True)
class SoakStop:
    """A planted hang: ``rank`` stops itself (SIGSTOP) just before it issues the cell's call
    ``call`` (1-based; every rank cuts the round that holds it short, so it begins a round): its
    ledger ends just before the call the others then wait in."""

    rank: int
    call: int


@dataclass(frozen=True)
class SoakJob:
    """The soak's all-reduces (``harness.rank.soak``): each round all-sums one float32 array of
    each gradient shape on ``stream`` ("cpu": ``stream=mx.cpu``; "default": none) and emits a
    ``step`` event; one call is one ``all_sum`` of one array. The shapes are ``shapes``, else the
    trainable parameters of ``config`` (an mlx-lm config, as it is), else of ``model`` built as
    the reference trainer builds it (``vocab_size``: its tokenizer's). ``calls``: this launch's
    calls (None: for ``seconds``, counted from the ranks' start, so that a launch queued for rank
    slots loses none of it; the ranks agree when to stop); ``first_call``:
    the calls the cell made before this launch (calls are numbered by the cell)."""

    shapes: tuple[tuple[int, ...], ...] = ()
    config: dict[str, Any] | None = None
    model: ModelSpec | None = None
    vocab_size: int = 0
    stream: str = "cpu"
    calls: int | None = None
    first_call: int = 0
    seconds: float | None = None
    stop: SoakStop | None = None
    world_size: int | None = None
    backend: str | None = None
    launched_at: float | None = None
    device: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)

    kind = "soak"
    scenario = None
    faults = ()

    @property
    def steps(self) -> int:
        """The rounds of this launch where known (one array a round), else 0."""
        return int(self.calls or 0) if len(self.shapes) == 1 else 0

    def launched(self, **launch: Any) -> SoakJob:
        return dataclasses.replace(self, **launch)

    def to_json(self) -> dict[str, Any]:
        out = {"kind": self.kind, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}
        out["shapes"] = [list(s) for s in self.shapes]
        out["model"] = None if self.model is None else dataclasses.asdict(self.model)
        out["stop"] = None if self.stop is None else dataclasses.asdict(self.stop)
        return {k: v for k, v in out.items() if v is not None and v != {}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SoakJob:
        known = {f.name for f in dataclasses.fields(cls)}
        _known(d, known, "soak job")
        fields = {k: v for k, v in d.items() if k in known}
        fields["shapes"] = tuple(tuple(int(n) for n in s) for s in d.get("shapes", ()))
        if d.get("model") is not None:
            _known(d["model"], {f.name for f in dataclasses.fields(ModelSpec)}, "soak job's model")
            fields["model"] = ModelSpec(**d["model"])
        if d.get("stop") is not None:
            _known(d["stop"], {"rank", "call"}, "soak job's stop")
            fields["stop"] = SoakStop(**d["stop"])
        return cls(**fields)


Job = TrainJob | AllSumJob | AnchorJob | SoakJob
KINDS: dict[str, type] = {TrainJob.kind: TrainJob, AllSumJob.kind: AllSumJob, "mlx_lm_step": AnchorJob,
                          "grad_allreduce": AnchorJob, SoakJob.kind: SoakJob}


def job_from_json(d: dict[str, Any]) -> Job:
    """The job a job file holds (``JobError`` for a kind this harness does not run)."""
    cls = KINDS.get(d.get("kind", ""))
    if cls is None:
        raise JobError(f"job kind {d.get('kind')!r} is not one of {', '.join(KINDS)}")
    return cls.from_json(d)
