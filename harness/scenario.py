"""Scenario specs: TOML files that read like test descriptions, parsed into dataclasses.

Every error names the file and the key (``ScenarioError``), so the CLI can print one line.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

TEXT_ARCHS = ("qwen3", "llama")
VLM_ARCHS = ("qwen2_vl", "paligemma")
ARCHS = TEXT_ARCHS + VLM_ARCHS
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
KINDS = ("parity", "throughput")
COMPILE_SCOPES = ("none", "local-grad", "full-step", "fallback-eager")
LR_SCHEDULES = ("constant", "cosine", "linear")


class ScenarioError(ValueError):
    """A scenario file is missing, unreadable or has a bad key; the message names both."""


@dataclass
class ModelSpec:
    """The model: an mlx-lm (text) or mlx-vlm (vision-language) architecture with seeded random
    weights, or a local model dir. ``config`` overrides keys of the tiny default config (for a VLM,
    ``vision_config`` / ``text_config`` tables update those sections key by key)."""

    arch: str = "qwen3"
    path: str | None = None
    dtype: str = "float32"
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def vision(self) -> bool:
        return self.arch in VLM_ARCHS


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
    failure: it passes when the run fails with a message containing that text (with
    ``expect_error_on_every_rank``, when every rank's own error contains it).
    ``expect_compile_scope`` and ``expect_stop_step`` are what every rank must report.

    Resume: ``stop_after`` ends the run cleanly after that step of its plan, with a checkpoint.
    ``resume_from`` names an earlier run of this scenario (its checkpoints) or a checkpoint
    directory; ``resume_step`` picks a checkpoint (default: the newest complete one), and
    ``expect_resume_step`` is the step every rank must have resumed from. ``compare_to`` names
    the run whose per-step losses, final parameters and token counts this run must reproduce.
    ``seed`` replaces the scenario seed for this run (a resumed run keeps its checkpoint's).

    ``mutation`` injects a known DDP bug into this run (see ``harness.rank.semantics``): the run
    must then be caught by at least one check with ``[checks] mutation_margin``.
    """

    name: str
    world_size: int
    backend: str | None = None
    train: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
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
    resumed run's median tok/s must be within this factor of that run's.

    ``mutation_margin``: a run with a ``mutation`` counts as caught when some check fails by at
    least this factor (value / limit).

    ``expected_failures``: check name -> the reason it is known to fail (for example a model
    whose forward depends on how a batch is split). Such a check still runs and reports its
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
    """A scenario file. ``kind``: ``parity`` runs train at one global batch and must match the
    reference run; ``throughput`` runs (for example the guide shape: per-rank batch 1, 4
    accumulation steps) may differ in global batch, are not compared for parity, and are
    reported by speed against the reference run."""

    name: str
    description: str = ""
    seed: int = 0
    default: bool = False
    kind: str = "parity"
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
            kind=d.get("kind", "parity"),
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


def require(cond: bool, src: str, key: str, msg: str) -> None:
    """Raise ``ScenarioError`` naming the file and the key unless ``cond`` holds."""
    if not cond:
        raise ScenarioError(f"{src}: {key}: {msg}")


def _resolve(path: str | None, base: Path, src: str, key: str) -> str | None:
    if path is None:
        return None
    require("{rank}" not in path, src, key,
             f"{path!r} is sharded per rank by the caller; give the whole dataset (each rank takes its own share)")
    p = (base / path).resolve() if not Path(path).is_absolute() else Path(path)
    require(p.exists(), src, key, f"path does not exist: {p}")
    return str(p)


def is_named_tokenizer(value: Any) -> bool:
    """``byte``, or ``bpe:N`` (trained at run time): a tokenizer named, not a file."""
    return isinstance(value, str) and (value == "byte" or value.startswith("bpe:"))


def writes_checkpoints(s: Scenario, run: RunSpec) -> bool:
    return run.stop_after is not None or s.for_run(run).train.checkpoint_every > 0


def parse_scenario(data: dict[str, Any], src: str, base: Path) -> Scenario:
    """Build and validate a scenario from parsed TOML; ``src`` names the file in errors."""
    top = {"scenario", "model", "data", "train", "checks", "limits", "runs", "faults"}
    for key in data:
        if key not in top:
            raise ScenarioError(f"{src}: [{key}]: unknown section (known: {', '.join(sorted(top))})")
    head = data.get("scenario")
    require(isinstance(head, dict), src, "[scenario]", "section is missing")
    allowed = {"name", "description", "seed", "default", "kind"}
    for key in head:
        require(key in allowed, src, f"[scenario].{key}", f"unknown key (known: {', '.join(sorted(allowed))})")
    name = head.get("name")
    require(isinstance(name, str) and name != "", src, "[scenario].name", "must be a non-empty string")
    seed = head.get("seed", 0)
    require(isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0, src,
             "[scenario].seed", f"must be a non-negative integer, got {seed!r}")
    desc = head.get("description", "")
    require(isinstance(desc, str), src, "[scenario].description", "must be a string")
    default = head.get("default", False)
    require(isinstance(default, bool), src, "[scenario].default", "must be true or false")
    kind = head.get("kind", "parity")
    require(kind in KINDS, src, "[scenario].kind", f"must be one of {', '.join(KINDS)}, got {kind!r}")

    def many(key: str, cls: type) -> list[Any]:
        items = data.get(key, [])
        require(isinstance(items, list), src, f"[[{key}]]", "must be an array of tables")
        return [_build(cls, t, f"[[{key}]][{i}]", src) for i, t in enumerate(items)]

    s = Scenario(
        name=name,
        description=desc,
        seed=seed,
        default=default,
        kind=kind,
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
            if key in r.data and not is_named_tokenizer(r.data[key]):
                r.data[key] = _resolve(r.data[key], base, src, f"[[runs]][{i}].data.{key}")
        if r.resume_from is not None and r.resume_from not in [run.name for run in s.runs]:
            r.resume_from = _resolve(r.resume_from, base, src, f"[[runs]][{i}].resume_from")
    s.model.path = _resolve(s.model.path, base, src, "[model].path")
    s.data.path = _resolve(s.data.path, base, src, "[data].path")
    s.data.eval_path = _resolve(s.data.eval_path, base, src, "[data].eval_path")
    if not is_named_tokenizer(s.data.tokenizer):
        s.data.tokenizer = _resolve(s.data.tokenizer, base, src, "[data].tokenizer")
    from harness.scenario_rules import validate

    validate(s, src)
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
