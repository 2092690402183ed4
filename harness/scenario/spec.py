"""Scenario specs: the dataclasses a scenario file is parsed into (one per section; the values
each key may take are in ``harness.scenario.names``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from harness.scenario.names import MUTATION_EXPECTS, VLM_ARCHS


class ScenarioError(ValueError):
    """A scenario file is missing, unreadable or has a bad key; the message names both."""


@dataclass
class TrainerSpec:
    """The trainer under test: ``kind``, a registered trainer (by default ``reference``, the
    harness's own DDP trainer; ``list`` names the others). ``fine_tune`` "full", or "lora" (for a
    trainer whose record has ``lora``) with ``lora_rank``, ``lora_scale`` and ``lora_layers``
    adapted layers (-1: all). A trainer that runs a user's code (its record's ``script`` or
    ``command``) takes its ``path`` and ``args`` (its command line); a script reporting through
    ``harness.api`` declares with ``saves = true`` that it saves on rank 0, which the judge then
    demands (the others' saves are in their records). ``collectives``: the collectives it calls
    beyond ``all_sum`` (``sum_scatter`` under ``nn.fully_shard``); a run on this machine whose
    backend lacks one is refused before launch."""

    kind: str = "reference"
    path: str | None = None
    args: list[str] = field(default_factory=list)
    fine_tune: str = "full"
    lora_rank: int = 8
    lora_scale: float = 20.0
    lora_layers: int = -1
    saves: bool | None = None
    collectives: list[str] = field(default_factory=list)  # what it calls beyond all_sum (sum_scatter for FSDP)


@dataclass
class ModelSpec:
    """The model: an mlx-lm (text) or mlx-vlm (vision-language) architecture with seeded random
    weights, or a local model dir. ``config`` overrides keys of the tiny default config (for a VLM,
    ``vision_config`` / ``text_config`` tables update those sections key by key)."""

    arch: str = "qwen3"
    path: str | None = None
    dtype: str | None = None  # None: not declared (float32 where the harness builds the model; else the weights')
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def vision(self) -> bool:
        return self.arch in VLM_ARCHS

    @property
    def built_dtype(self) -> str:
        """The dtype the harness builds the model in: ``dtype``, float32 where it is left out."""
        return self.dtype or "float32"


@dataclass
class DataSpec:
    """Training and eval rows: the built-in generated corpus, real English prose (``prose``: the
    paragraphs of the documentation topics every Python ships, held-out rows from its end),
    generated captioned images (``images``, drawn at ``image_size`` pixels), or local JSONL rows
    (text rows, or image rows ``{"image": path, "caption" | "messages"}`` for a VLM; larger images
    are scaled to fit ``image_size``). ``tokenizer``: ``byte``, a local ``tokenizer.json``, or
    ``bpe:N``, a byte-level BPE of N tokens trained on the train rows before the run (cached).

    ``format`` is the row form: ``text`` (``{"text"}``), ``prompt_completion``
    (``{"prompt", "completion"}``) or ``chat`` (``{"messages": [{"role", "content"}]}``); ``auto``
    means ``text`` for generated data and the first row's form for JSONL. ``response_only`` puts
    the loss on completion / assistant tokens only.
    """

    source: str = "generated"
    path: str | None = None
    format: str = "auto"
    response_only: bool = True
    rows: int = 96
    min_chars: int = 24
    max_chars: int = 120
    max_seq_len: int = 160
    tokenizer: str = "byte"
    order: str = "ordered"
    streaming: bool = False
    eval_rows: int = 0
    eval_path: str | None = None
    image_size: int = 56


@dataclass
class TrainSpec:
    """The optimisation: global batch (split across ranks and ``grad_accum`` micro-steps), steps,
    the optimizer (``adamw``, or ``sgd``: plain SGD, which keeps no state but its step) with an
    optional warmup + decay schedule and gradient clipping (``max_grad_norm`` > 0),
    the compile mode, how often to evaluate, and how often to write a checkpoint (``checkpoint_every``
    steps, keeping the newest ``keep_last``; 0 keeps all).

    ``precision``: how float32 matmuls compute. ``full``: at float32 (TF32 off on CUDA, where MLX
    uses TF32 by default); ``device``: the device's default; ``auto`` (the default): ``full`` in a
    parity scenario, whose verdicts must see defects of 1e-3 and less, ``device`` in a throughput
    scenario, which times what users train with.

    ``grad_norms``: whether the reference trainer computes and records the global gradient
    norm of every step, a diagnostic no update reads (clipping computes its own): ``auto`` (the
    default) records it in a parity scenario and leaves it out of a throughput scenario, where it
    would time work the trainers beside it do not do (1.5% of a compiled CPU step); ``on``, ``off``.

    ``pad_to``: the reference trainer pads each micro-batch's input width up to a multiple of it
    (masked), as mlx-lm's ``iterate_batches`` pads to 32: MLX's CUDA backend trains a width that
    is not a multiple of 32 at about half speed. 1 pads to the longest row only.

    ``device``: what every rank computes on. ``gpu``, ``cpu``, or ``auto`` (the default): the GPU
    where MLX sees a real one (CUDA or Metal), else the CPU (``harness.controller.devices.plan_device``)."""

    steps: int = 20
    global_batch: int = 8
    grad_accum: int = 1
    learning_rate: float = 3e-3
    optimizer: str = "adamw"
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0
    input_dropout: float = 0.0
    compile: str = "off"
    precision: str = "auto"
    eval_every: int = 0
    eval_batch: int = 4
    pad_to: int = 32
    grad_norms: str = "auto"
    digest_every: int = 0
    checkpoint_every: int = 0
    keep_last: int = 2
    device: str = "auto"


@dataclass
class RunSpec:
    """One launch of the scenario at a given world size.

    ``train`` and ``data`` override keys of the scenario's sections for this run only (for
    example ``train = { compile = "strict" }``). ``expect_error`` makes the run an expected
    failure: it passes when the run fails with a message containing that text (with
    ``expect_error_on_every_rank``, when every rank's own error contains it).
    ``expect_compile_scope`` and ``expect_stop_step`` are what every rank must report.

    Resume: ``stop_after`` ends the run cleanly after that step of its plan, with a checkpoint.
    ``resume_from`` names an earlier run of this scenario (its checkpoints) or a checkpoint
    directory; ``resume_step`` picks a checkpoint (default: the newest complete one), and
    ``expect_resume_step`` is the step every rank must have resumed from. ``compare_to`` names
    the run whose per-step losses, final parameters and token counts this run must reproduce.
    ``seed`` replaces the scenario seed for this run (a resumed run keeps its checkpoint's).

    ``trainer`` overrides keys of ``[trainer]`` for this run (throughput scenarios only, to time
    several trainers beside each other, e.g. ``trainer = { kind = "<another kind>" }``).

    ``mutation`` injects a known DDP bug into this run (see ``harness.trainers.reference.semantics``): the run
    must then be caught by at least one check with ``[checks] mutation_margin``.
    """

    name: str
    world_size: int
    backend: str | None = None
    train: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    expect_error: str | None = None
    expect_error_on_every_rank: bool = False
    expect_compile_scope: str | None = None
    expect_stop_step: int | None = None
    seed: int | None = None
    stop_after: int | None = None
    resume_from: str | None = None
    resume_step: int | None = None
    expect_resume_step: int | None = None
    compare_to: str | None = None
    mutation: str | None = None

    @property
    def fails_by_design(self) -> bool:
        """Expected to fail: an ``expect_error`` run, or one whose mutation kills a rank."""
        return self.expect_error is not None or MUTATION_EXPECTS.get(self.mutation or "") == "rank_failure"

    def writes_checkpoints(self, train: TrainSpec) -> bool:
        """Whether it writes checkpoints, given its effective ``[train]``."""
        return self.stop_after is not None or train.checkpoint_every > 0


@dataclass
class CheckSpec:
    """How runs are judged; ``None`` ceilings are not checked.

    Parity with the reference run is judged two ways. *Step-local*: at step 1 and every
    ``probe_every`` steps each compared run computes its global loss, token count and gradient
    at the reference's parameters; their relative errors must stay within ``rounding_ulps`` x
    (2^-24 x ceil(log2 T) + u x (grad_accum + ceil(log2 N))), the rounding of float32
    accumulation over T tokens plus u (the dtype's, or the device matmul's measured, unit
    roundoff) per rounding of stored partial sums. *Trajectory*: per-step losses, eval losses
    and final parameters are compared with a measured noise floor, the deviation of the reference
    re-run in one process with every sum in reverse order (the same mathematics, another
    summation order); a run fails when it deviates more than ``floor_ratio`` x that floor (an
    absolute floor of one step's rounding limit keeps a zero floor from demanding bitwise
    equality). ``loss_tolerance``, ``param_tolerance`` and ``eval_tolerance`` replace the
    trajectory criterion with an absolute limit (a scenario that sets one should say why);
    ``noise_floor = false`` runs no floor runs and then needs them (and ``resume_tolerance`` for
    resumes).

    ``data_share_slack``: a rank of an N-rank run may hold at most (1 + slack) x its share (1/N,
    or ceil(m/N)/m for micro-batches of m rows) of the data bytes the reference run's rank holds
    (uneven row lengths and padding rows need the slack).

    Resume: a resumed run must reproduce its ``compare_to`` run up to the device's own run-to-run
    variation, measured by running ``compare_to`` twice: bitwise when the two agree bitwise (CPU),
    else within ``floor_ratio`` x their deviation. ``resume_tolerance`` replaces that with an
    absolute limit. Across world sizes the parity criterion applies. ``resume_tok_s_factor``: the
    resumed run's fastest step (after its first) must be within this factor of that run's over
    the same steps, in tok/s.

    ``mutation_margin``: a run with a ``mutation`` counts as caught when some check fails by at
    least this factor (value / limit). ``mutations = "collectives"`` adds one run per collective
    mutation, each a copy of the scenario's first run of two or more ranks compared with the
    reference, named after its mutation (``harness.scenario.load``): the scenario then proves its
    checks' power on its own trainer.

    ``expected_failures``: check name -> the reason it is known to fail (for example a model
    whose forward depends on how a batch is split), or a table of run name -> reason where it is
    known to fail in some runs only. Such a check still runs and reports its
    measured value; failing is then "xfail" and does not fail the scenario, passing is an
    unexpected pass ("XPASS"), which does: the known problem is gone, so the marker must go too.
    """

    reference: str | None = None
    loss_tolerance: float | None = None
    param_tolerance: float | None = None
    eval_tolerance: float | None = None
    floor_ratio: float = 10.0
    rounding_ulps: float = 4.0
    probe_every: int = 5
    noise_floor: bool = True
    mutation_margin: float = 10.0
    mutations: str | None = None
    max_rss_mb: float | None = None
    max_mlx_mb: float | None = None
    max_total_rss_mb: float | None = None
    max_total_mlx_mb: float | None = None
    data_share_slack: float = 0.5
    resume_tolerance: float | None = None
    resume_tok_s_factor: float = 3.0
    expected_failures: dict[str, Any] = field(default_factory=dict)


@dataclass
class LimitSpec:
    """Watchdog limits for each run: time in seconds; hard memory limits enforced while it runs
    (``harness.memory.guard``): per rank ``hard_rss_mb`` (RSS above the rank's
    baseline) and ``hard_mlx_mb``, by default the larger of ``hard_memory_factor`` x the
    ``[checks]`` ceiling and the ceiling + ``hard_memory_slack_mb``, where one is set; all ranks
    together at most ``machine_memory_fraction`` of the machine. ``memory_budget_mb``: the memory
    this scenario's runs share, where lower than the machine's budget (``harness.memory.plan``)."""

    wall_s: float = 600.0
    no_progress_s: float = 120.0
    hard_rss_mb: float | None = None
    hard_mlx_mb: float | None = None
    hard_memory_factor: float = 3.0
    hard_memory_slack_mb: float = 256.0
    machine_memory_fraction: float = 0.9
    memory_budget_mb: float | None = None


@dataclass
class FaultSpec:
    """Make ``rank`` misbehave at optimizer step ``step`` in ``phase`` (to prove failure handling).

    In the ``device_check`` phase (before training; ``step`` is not used there) ``wrong_result``
    makes the rank's device check see a wrong matmul, as a device that computes wrong would.

    ``stop`` requests an early stop as a callback would; ``compile_error`` makes the rank's
    compiled step fail to trace (eager still works). In the ``checkpoint`` phase a kill happens
    mid-write (after the first file); ``truncate``, ``corrupt`` and ``delete`` damage ``file`` of
    the checkpoint just written, as failing storage would. In the ``resume`` phase (``step``: the
    checkpoint's step) ``stale_view`` makes the rank miss the newest checkpoint. In the ``record``
    phase (``step`` not used) ``delay`` makes the rank write its result ``RECORD_DELAY_S`` late, as
    a rank slowed by a loaded machine would.
    """

    rank: int
    step: int
    action: str
    code: int = 3
    phase: str = "step"
    runs: list[str] = field(default_factory=list)
    file: str = "model.safetensors"
    mb: int = 0


@dataclass
class Scenario:
    """A scenario file. ``kind``: ``parity`` runs train at one global batch and must match the
    reference run; ``throughput`` runs (for example the guide shape: per-rank batch 1, 4
    accumulation steps) may differ in global batch, are not compared for parity, and are
    reported by speed against the reference run. ``default``: in its directory's default set
    (what ``run`` runs with no file named); ``full``: in the full set (``run --all``), as every
    default one is."""

    name: str
    description: str = ""
    seed: int = 0
    default: bool = False
    full: bool = False
    kind: str = "parity"
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    checks: CheckSpec = field(default_factory=CheckSpec)
    limits: LimitSpec = field(default_factory=LimitSpec)
    runs: list[RunSpec] = field(default_factory=list)
    faults: list[FaultSpec] = field(default_factory=list)
    path: str | None = None
    cluster: dict[str, Any] | None = None  # [cluster]: hosts to run on (``harness.cluster_spec``)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scenario:
        """Rebuild a scenario from ``to_dict`` output (as sent to ranks in the job file)."""
        d = dict(data)
        return cls(
            name=d["name"],
            description=d["description"],
            seed=d["seed"],
            default=d["default"],
            full=d.get("full", d["default"]),
            kind=d.get("kind", "parity"),
            trainer=TrainerSpec(**d.get("trainer", {})),
            model=ModelSpec(**d["model"]),
            data=DataSpec(**d["data"]),
            train=TrainSpec(**d["train"]),
            checks=CheckSpec(**d["checks"]),
            limits=LimitSpec(**d["limits"]),
            runs=[RunSpec(**r) for r in d["runs"]],
            faults=[FaultSpec(**f) for f in d["faults"]],
            path=d["path"],
            cluster=d.get("cluster"),
        )

    def run(self, name: str) -> RunSpec:
        for r in self.runs:
            if r.name == name:
                return r
        raise KeyError(name)

    def for_run(self, run: RunSpec) -> Scenario:
        """This scenario as one run sees it: the run's overrides applied (``precision`` and
        ``grad_norms`` ``"auto"`` resolved by the scenario's kind), its faults only."""
        train = dataclasses.replace(self.train, **run.train)
        if train.precision == "auto":
            train = dataclasses.replace(train, precision="full" if self.kind == "parity" else "device")
        if train.grad_norms == "auto":
            train = dataclasses.replace(train, grad_norms="on" if self.kind == "parity" else "off")
        return dataclasses.replace(
            self,
            seed=self.seed if run.seed is None else run.seed,
            data=dataclasses.replace(self.data, **run.data),
            train=train,
            trainer=dataclasses.replace(self.trainer, **run.trainer),
            faults=[f for f in self.faults if not f.runs or run.name in f.runs],
        )



def is_behaviour_table(value: Any) -> bool:
    """Whether a ``[checks.expected_failures]`` entry is a behaviour table (it has ``checks``;
    ``harness.judge.behaviours``)."""
    return isinstance(value, dict) and "checks" in value


def require(cond: bool, src: str, key: str, msg: str) -> None:
    """Raise ``ScenarioError`` naming the file and the key unless ``cond`` holds."""
    if not cond:
        raise ScenarioError(f"{src}: {key}: {msg}")


def writes_checkpoints(s: Scenario, run: RunSpec) -> bool:
    return run.writes_checkpoints(s.for_run(run).train)


def compared(s: Scenario, run: RunSpec) -> bool:
    """Whether ``run`` is judged for parity with the reference."""
    ref = s.checks.reference
    return s.kind == "parity" and ref is not None and run.name != ref and not run.fails_by_design
