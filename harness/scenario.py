"""Scenario specs: TOML files that read like test descriptions, parsed into dataclasses.

Every error names the file and the key (``ScenarioError``), so the CLI can print one line.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ARCHS = ("qwen3", "llama")
DTYPES = ("float32", "bfloat16", "float16")
BACKENDS = ("ring", "nccl", "mpi", "jaccl")
FAULT_ACTIONS = ("raise", "exit", "sigkill", "segfault", "hang", "exit0", "stop", "compile_error",
                 "truncate", "corrupt", "delete", "stale_view")
FAULT_PHASES = ("fetch", "step", "update", "eval", "checkpoint", "resume", "save")
DAMAGE_ACTIONS = ("truncate", "corrupt", "delete")
CHECKPOINT_FILES = ("model.safetensors", "optimizer.safetensors", "trainer.json", "manifest.json")
DATA_FORMATS = ("auto", "text", "prompt_completion", "chat")
ORDERS = ("ordered", "shuffled", "length_sorted")
COMPILE_MODES = ("off", "strict", "best_effort")
COMPILE_SCOPES = ("none", "local-grad", "full-step", "fallback-eager")
LR_SCHEDULES = ("constant", "cosine", "linear")


class ScenarioError(ValueError):
    """A scenario file is missing, unreadable or has a bad key; the message names both."""


@dataclass
class ModelSpec:
    """The model: an mlx-lm architecture with seeded random weights, or a local model dir."""

    arch: str = "qwen3"
    path: str | None = None
    dtype: str = "float32"
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataSpec:
    """Training and eval rows: the built-in generated corpus, or local JSONL rows.

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


@dataclass
class TrainSpec:
    """The optimisation: global batch (split across ranks and ``grad_accum`` micro-steps), steps,
    AdamW with an optional warmup + decay schedule and gradient clipping (``max_grad_norm`` > 0),
    the compile mode, how often to evaluate, and how often to write a checkpoint (``checkpoint_every``
    steps, keeping the newest ``keep_last``; 0 keeps all)."""

    steps: int = 20
    global_batch: int = 8
    grad_accum: int = 1
    learning_rate: float = 3e-3
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0
    input_dropout: float = 0.0
    compile: str = "off"
    eval_every: int = 0
    eval_batch: int = 4
    digest_every: int = 0
    checkpoint_every: int = 0
    keep_last: int = 2


@dataclass
class RunSpec:
    """One launch of the scenario at a given world size.

    ``train`` and ``data`` override keys of the scenario's sections for this run only (for
    example ``train = { compile = "strict" }``). ``expect_error`` makes the run an expected
    failure: it passes when the run fails with a message containing that text.
    ``expect_compile_scope`` and ``expect_stop_step`` are what every rank must report.

    Resume: ``stop_after`` ends the run cleanly after that step of its plan, with a checkpoint.
    ``resume_from`` names an earlier run of this scenario (its checkpoints) or a checkpoint
    directory; ``resume_step`` picks a checkpoint (default: the newest complete one), and
    ``expect_resume_step`` is the step every rank must have resumed from. ``compare_to`` names
    the run whose per-step losses, final parameters and token counts this run must reproduce.
    ``seed`` replaces the scenario seed for this run (a resumed run keeps its checkpoint's).
    """

    name: str
    world_size: int
    backend: str | None = None
    train: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    expect_error: str | None = None
    expect_compile_scope: str | None = None
    expect_stop_step: int | None = None
    seed: int | None = None
    stop_after: int | None = None
    resume_from: str | None = None
    resume_step: int | None = None
    expect_resume_step: int | None = None
    compare_to: str | None = None


@dataclass
class CheckSpec:
    """Tolerances and ceilings the judge applies; ``None`` ceilings are not checked.

    ``data_share_slack``: a rank of an N-rank run may hold at most (1 + slack) x its share (1/N,
    or ceil(m/N)/m for micro-batches of m rows) of the data bytes the reference run's rank holds
    (uneven row lengths and padding rows need the slack).

    ``resume_tolerance``: max |delta| of losses and parameters between a resumed run and the run
    it must reproduce when both have the same world size (0: bitwise); on a GPU, whose kernels
    are not run-to-run deterministic, ``resume_tolerance_gpu`` instead; across world sizes the
    parity tolerances apply. ``resume_tok_s_factor``: the resumed run's median tok/s must be
    within this factor of that run's.
    """

    reference: str | None = None
    loss_tolerance: float = 1e-5
    param_tolerance: float = 1e-5
    max_rss_mb: float | None = None
    max_mlx_mb: float | None = None
    max_total_rss_mb: float | None = None
    max_total_mlx_mb: float | None = None
    eval_tolerance: float = 1e-5
    data_share_slack: float = 0.5
    resume_tolerance: float = 0.0
    resume_tolerance_gpu: float = 3e-4
    resume_tok_s_factor: float = 3.0


@dataclass
class LimitSpec:
    """Watchdog limits for each run, in seconds."""

    wall_s: float = 600.0
    no_progress_s: float = 120.0


@dataclass
class FaultSpec:
    """Make ``rank`` misbehave at optimizer step ``step`` in ``phase`` (to prove failure handling).

    ``stop`` requests an early stop as a callback would; ``compile_error`` makes the rank's
    compiled step fail to trace (eager still works). In the ``checkpoint`` phase a kill happens
    mid-write (after the first file); ``truncate``, ``corrupt`` and ``delete`` damage ``file`` of
    the checkpoint just written, as failing storage would. In the ``resume`` phase (``step``: the
    checkpoint's step) ``stale_view`` makes the rank miss the newest checkpoint.
    """

    rank: int
    step: int
    action: str
    code: int = 3
    phase: str = "step"
    runs: list[str] = field(default_factory=list)
    file: str = "model.safetensors"


@dataclass
class Scenario:
    name: str
    description: str = ""
    seed: int = 0
    default: bool = False
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    checks: CheckSpec = field(default_factory=CheckSpec)
    limits: LimitSpec = field(default_factory=LimitSpec)
    runs: list[RunSpec] = field(default_factory=list)
    faults: list[FaultSpec] = field(default_factory=list)
    path: str | None = None

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
            model=ModelSpec(**d["model"]),
            data=DataSpec(**d["data"]),
            train=TrainSpec(**d["train"]),
            checks=CheckSpec(**d["checks"]),
            limits=LimitSpec(**d["limits"]),
            runs=[RunSpec(**r) for r in d["runs"]],
            faults=[FaultSpec(**f) for f in d["faults"]],
            path=d["path"],
        )

    def run(self, name: str) -> RunSpec:
        for r in self.runs:
            if r.name == name:
                return r
        raise KeyError(name)

    def for_run(self, run: RunSpec) -> Scenario:
        """This scenario as one run sees it: the run's overrides applied, its faults only."""
        return dataclasses.replace(
            self,
            seed=self.seed if run.seed is None else run.seed,
            data=dataclasses.replace(self.data, **run.data),
            train=dataclasses.replace(self.train, **run.train),
            faults=[f for f in self.faults if not f.runs or run.name in f.runs],
        )


def _type_ok(value: Any, annotation: str) -> bool:
    kinds = {
        "str": (str,),
        "int": (int,),
        "float": (int, float),
        "bool": (bool,),
        "dict[str, Any]": (dict,),
        "list[str]": (list,),
    }
    optional = annotation.endswith(" | None")
    base = annotation.removesuffix(" | None")
    if value is None:
        return optional
    if isinstance(value, bool) and base != "bool":
        return False
    if base == "list[str]":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, kinds[base])


def _coerce(cls: type, table: Any, where: str, src: str) -> dict[str, Any]:
    """Check a TOML table's keys and value types against ``cls``'s fields."""
    if not isinstance(table, dict):
        raise ScenarioError(f"{src}: {where} must be a table")
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key not in known:
            raise ScenarioError(f"{src}: {where}.{key}: unknown key (known: {', '.join(known)})")
        if not _type_ok(value, str(known[key].type)):
            raise ScenarioError(f"{src}: {where}.{key}: expected {known[key].type}, got {value!r}")
        kwargs[key] = float(value) if known[key].type.startswith("float") and value is not None else value
    return kwargs


def _build(cls: type, table: Any, where: str, src: str) -> Any:
    kwargs = _coerce(cls, table, where, src)
    missing = [
        f.name
        for f in fields(cls)
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in kwargs
    ]
    if missing:
        raise ScenarioError(f"{src}: {where}.{missing[0]}: required key is missing")
    return cls(**kwargs)


def _require(cond: bool, src: str, key: str, msg: str) -> None:
    if not cond:
        raise ScenarioError(f"{src}: {key}: {msg}")


def _resolve(path: str | None, base: Path, src: str, key: str) -> str | None:
    if path is None:
        return None
    _require("{rank}" not in path, src, key,
             f"{path!r} is sharded per rank by the caller; give the whole dataset (each rank takes its own share)")
    p = (base / path).resolve() if not Path(path).is_absolute() else Path(path)
    _require(p.exists(), src, key, f"path does not exist: {p}")
    return str(p)


def _one_of(value: Any, allowed: tuple[str, ...], src: str, key: str) -> None:
    _require(value in allowed, src, key, f"must be one of {allowed}, got {value!r}")


def _validate_data(d: DataSpec, src: str, where: str) -> None:
    _one_of(d.source, ("generated", "jsonl"), src, f"{where}.source")
    _one_of(d.format, DATA_FORMATS, src, f"{where}.format")
    _one_of(d.order, ORDERS, src, f"{where}.order")
    _require(d.source != "jsonl" or d.path is not None, src, f"{where}.path", "required when source = 'jsonl'")
    for key in ("rows", "min_chars", "max_chars", "max_seq_len"):
        _require(getattr(d, key) > 0, src, f"{where}.{key}", "must be positive")
    _require(d.max_seq_len >= 2, src, f"{where}.max_seq_len", "must be at least 2")
    _require(d.min_chars <= d.max_chars, src, f"{where}.min_chars", "must not exceed max_chars")
    _require(d.eval_rows >= 0, src, f"{where}.eval_rows", "must be >= 0")
    _require(not d.streaming or d.order == "ordered", src, f"{where}.order",
             "a streaming source is read in order: use order = 'ordered'")


def _validate_train(t: TrainSpec, d: DataSpec, src: str, where: str) -> None:
    _require(t.steps > 0, src, f"{where}.steps", "must be positive")
    _require(t.global_batch > 0, src, f"{where}.global_batch", "must be positive")
    _require(t.grad_accum >= 1, src, f"{where}.grad_accum", "must be >= 1")
    _require(t.global_batch % t.grad_accum == 0, src, f"{where}.grad_accum",
             f"global_batch {t.global_batch} does not divide into {t.grad_accum} micro-steps")
    _require(t.learning_rate > 0, src, f"{where}.learning_rate", "must be positive")
    _one_of(t.lr_schedule, LR_SCHEDULES, src, f"{where}.lr_schedule")
    _require(0 <= t.warmup_steps <= t.steps, src, f"{where}.warmup_steps", "must be between 0 and steps")
    _require(0 <= t.min_lr_ratio <= 1, src, f"{where}.min_lr_ratio", "must be between 0 and 1")
    _require(t.max_grad_norm >= 0, src, f"{where}.max_grad_norm", "must be >= 0 (0: no clipping)")
    _require(0 <= t.input_dropout < 1, src, f"{where}.input_dropout", "must be in [0, 1)")
    _one_of(t.compile, COMPILE_MODES, src, f"{where}.compile")
    _require(t.digest_every >= 0, src, f"{where}.digest_every", "must be >= 0")
    _require(t.eval_every >= 0, src, f"{where}.eval_every", "must be >= 0")
    _require(t.eval_batch >= 1, src, f"{where}.eval_batch", "must be >= 1")
    _require(t.checkpoint_every >= 0, src, f"{where}.checkpoint_every", "must be >= 0 (0: no periodic checkpoints)")
    _require(t.keep_last >= 0, src, f"{where}.keep_last", "must be >= 0 (0: keep every checkpoint)")
    _require(t.eval_every == 0 or d.eval_rows > 0 or d.eval_path is not None, src, f"{where}.eval_every",
             "needs eval rows: set [data].eval_rows or [data].eval_path")


def writes_checkpoints(s: Scenario, run: RunSpec) -> bool:
    return run.stop_after is not None or s.for_run(run).train.checkpoint_every > 0


def _validate_resume(s: Scenario, i: int, r: RunSpec, names: list[str], src: str) -> None:
    where = f"[[runs]][{i}]"
    steps = s.for_run(r).train.steps
    _require(r.seed is None or r.seed >= 0, src, f"{where}.seed", "must be a non-negative integer")
    _require(r.stop_after is None or 1 <= r.stop_after < steps, src, f"{where}.stop_after",
             f"must be between 1 and {steps - 1} (the run's steps - 1)")
    if r.resume_from in names:
        j = names.index(r.resume_from)
        _require(j < i, src, f"{where}.resume_from", f"run {r.resume_from!r} must come before this run")
        _require(writes_checkpoints(s, s.runs[j]), src, f"{where}.resume_from",
                 f"run {r.resume_from!r} writes no checkpoints (set checkpoint_every or stop_after)")
    for key in ("resume_step", "expect_resume_step"):
        value = getattr(r, key)
        _require(value is None or r.resume_from is not None, src, f"{where}.{key}", "needs resume_from")
        _require(value is None or 1 <= value < steps, src, f"{where}.{key}", f"must be between 1 and {steps - 1}")
    _require(r.compare_to is None or (r.compare_to in names and r.compare_to != r.name), src,
             f"{where}.compare_to", f"{r.compare_to!r} is not another run's name ({', '.join(names)})")


def _validate_fault(f: FaultSpec, where: str, src: str) -> None:
    _one_of(f.action, FAULT_ACTIONS, src, f"{where}.action")
    _one_of(f.phase, FAULT_PHASES, src, f"{where}.phase")
    _one_of(f.file, CHECKPOINT_FILES, src, f"{where}.file")
    _require(f.action != "stop" or f.phase in ("step", "eval"), src, f"{where}.phase",
             "a stop is requested after a step or after eval: use phase 'step' or 'eval'")
    _require(f.action != "compile_error" or f.phase == "step", src, f"{where}.phase",
             "compile_error happens in the step phase")
    _require(f.action not in DAMAGE_ACTIONS or f.phase == "checkpoint", src, f"{where}.phase",
             f"{f.action} damages a checkpoint just written: use phase 'checkpoint'")
    _require(f.action != "stale_view" or f.phase == "resume", src, f"{where}.phase",
             "stale_view happens while resuming: use phase 'resume'")


def _validate(s: Scenario, src: str) -> None:
    _one_of(s.model.arch, ARCHS, src, "[model].arch")
    _one_of(s.model.dtype, DTYPES, src, "[model].dtype")
    _validate_data(s.data, src, "[data]")
    _validate_train(s.train, s.data, src, "[train]")
    _require(len(s.runs) > 0, src, "[[runs]]", "at least one run is required")
    names = [r.name for r in s.runs]
    _require(len(set(names)) == len(names), src, "[[runs]].name", "run names must be unique")
    for i, r in enumerate(s.runs):
        where = f"[[runs]][{i}]"
        key = f"{where}.world_size"
        _require(r.world_size >= 1, src, key, f"must be >= 1, got {r.world_size}")
        _require(r.backend is None or r.backend in BACKENDS, src, f"{where}.backend", f"must be one of {BACKENDS}")
        _require(r.expect_compile_scope is None or r.expect_compile_scope in COMPILE_SCOPES, src,
                 f"{where}.expect_compile_scope", f"must be one of {COMPILE_SCOPES}")
        eff = s.for_run(r)
        _validate_data(eff.data, src, f"{where}.data")
        _validate_train(eff.train, eff.data, src, f"{where}.train")
        micro = eff.train.global_batch // eff.train.grad_accum
        _require(r.world_size <= micro, src, key,
                 f"{r.world_size} exceeds the {micro} rows of each micro-step "
                 f"([train].global_batch / grad_accum): a rank would get no rows")
        _validate_resume(s, i, r, names, src)
    ref = s.checks.reference
    _require(ref is None or ref in names, src, "[checks].reference",
             f"{ref!r} is not a run name ({', '.join(names)})")
    for key in ("loss_tolerance", "param_tolerance", "eval_tolerance", "data_share_slack", "resume_tolerance",
                "resume_tolerance_gpu"):
        _require(getattr(s.checks, key) >= 0, src, f"[checks].{key}", "must be >= 0")
    _require(s.limits.wall_s > 0 and s.limits.no_progress_s > 0, src, "[limits]",
             "limits must be positive")
    for i, f in enumerate(s.faults):
        _validate_fault(f, f"[[faults]][{i}]", src)
        _require(f.step >= 1, src, f"[[faults]][{i}].step", "must be >= 1")
        _require(f.rank >= 0, src, f"[[faults]][{i}].rank", "must be >= 0")
        unknown = [n for n in f.runs if n not in names]
        _require(not unknown, src, f"[[faults]][{i}].runs", f"unknown run names {unknown}")


def parse_scenario(data: dict[str, Any], src: str, base: Path) -> Scenario:
    """Build and validate a scenario from parsed TOML; ``src`` names the file in errors."""
    top = {"scenario", "model", "data", "train", "checks", "limits", "runs", "faults"}
    for key in data:
        if key not in top:
            raise ScenarioError(f"{src}: [{key}]: unknown section (known: {', '.join(sorted(top))})")
    head = data.get("scenario")
    _require(isinstance(head, dict), src, "[scenario]", "section is missing")
    allowed = {"name", "description", "seed", "default"}
    for key in head:
        _require(key in allowed, src, f"[scenario].{key}", f"unknown key (known: {', '.join(sorted(allowed))})")
    name = head.get("name")
    _require(isinstance(name, str) and name != "", src, "[scenario].name", "must be a non-empty string")
    seed = head.get("seed", 0)
    _require(isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0, src,
             "[scenario].seed", f"must be a non-negative integer, got {seed!r}")
    desc = head.get("description", "")
    _require(isinstance(desc, str), src, "[scenario].description", "must be a string")
    default = head.get("default", False)
    _require(isinstance(default, bool), src, "[scenario].default", "must be true or false")

    def many(key: str, cls: type) -> list[Any]:
        items = data.get(key, [])
        _require(isinstance(items, list), src, f"[[{key}]]", "must be an array of tables")
        return [_build(cls, t, f"[[{key}]][{i}]", src) for i, t in enumerate(items)]

    s = Scenario(
        name=name,
        description=desc,
        seed=seed,
        default=default,
        model=_build(ModelSpec, data.get("model", {}), "[model]", src),
        data=_build(DataSpec, data.get("data", {}), "[data]", src),
        train=_build(TrainSpec, data.get("train", {}), "[train]", src),
        checks=_build(CheckSpec, data.get("checks", {}), "[checks]", src),
        limits=_build(LimitSpec, data.get("limits", {}), "[limits]", src),
        runs=many("runs", RunSpec),
        faults=many("faults", FaultSpec),
        path=src,
    )
    for i, r in enumerate(s.runs):
        r.train = _coerce(TrainSpec, r.train, f"[[runs]][{i}].train", src)
        r.data = _coerce(DataSpec, r.data, f"[[runs]][{i}].data", src)
        for key in ("path", "eval_path", "tokenizer"):
            if key in r.data and r.data[key] != "byte":
                r.data[key] = _resolve(r.data[key], base, src, f"[[runs]][{i}].data.{key}")
        if r.resume_from is not None and r.resume_from not in [run.name for run in s.runs]:
            r.resume_from = _resolve(r.resume_from, base, src, f"[[runs]][{i}].resume_from")
    s.model.path = _resolve(s.model.path, base, src, "[model].path")
    s.data.path = _resolve(s.data.path, base, src, "[data].path")
    s.data.eval_path = _resolve(s.data.eval_path, base, src, "[data].eval_path")
    if s.data.tokenizer != "byte":
        s.data.tokenizer = _resolve(s.data.tokenizer, base, src, "[data].tokenizer")
    _validate(s, src)
    return s


def load_scenario(path: Path | str) -> Scenario:
    """Read and validate one scenario file."""
    p = Path(path)
    if not p.is_file():
        raise ScenarioError(f"{p}: scenario file not found")
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ScenarioError(f"{p}: unreadable ({e})") from e
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{p}: malformed TOML ({e})") from e
    return parse_scenario(data, str(p), p.parent)


def discover(directory: Path | str) -> list[Path]:
    """Scenario files in ``directory``, sorted by name."""
    return sorted(Path(directory).glob("*.toml"))
