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
FAULT_ACTIONS = ("raise", "exit", "sigkill", "segfault", "hang", "exit0")


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
    """Training rows: the built-in generated corpus, or local JSONL ``{"text": ...}`` rows."""

    source: str = "generated"
    path: str | None = None
    rows: int = 96
    min_chars: int = 24
    max_chars: int = 120
    max_seq_len: int = 160
    tokenizer: str = "byte"


@dataclass
class TrainSpec:
    """The optimisation: global batch (split across ranks), steps and optimizer."""

    steps: int = 20
    global_batch: int = 8
    learning_rate: float = 3e-3
    weight_decay: float = 0.0
    digest_every: int = 0


@dataclass
class RunSpec:
    """One launch of the scenario at a given world size."""

    name: str
    world_size: int
    backend: str | None = None


@dataclass
class CheckSpec:
    """Tolerances and ceilings the judge applies; ``None`` ceilings are not checked."""

    reference: str | None = None
    loss_tolerance: float = 1e-5
    param_tolerance: float = 1e-5
    max_rss_mb: float | None = None
    max_mlx_mb: float | None = None
    max_total_rss_mb: float | None = None
    max_total_mlx_mb: float | None = None


@dataclass
class LimitSpec:
    """Watchdog limits for each run, in seconds."""

    wall_s: float = 600.0
    no_progress_s: float = 120.0


@dataclass
class FaultSpec:
    """Make ``rank`` misbehave at optimizer step ``step`` (used to prove failure handling)."""

    rank: int
    step: int
    action: str
    code: int = 3


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


def _type_ok(value: Any, annotation: str) -> bool:
    kinds = {
        "str": (str,),
        "int": (int,),
        "float": (int, float),
        "bool": (bool,),
        "dict[str, Any]": (dict,),
    }
    optional = annotation.endswith(" | None")
    base = annotation.removesuffix(" | None")
    if value is None:
        return optional
    if isinstance(value, bool) and base != "bool":
        return False
    return isinstance(value, kinds[base])


def _build(cls: type, table: Any, where: str, src: str) -> Any:
    if not isinstance(table, dict):
        raise ScenarioError(f"{src}: {where} must be a table")
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key not in known:
            raise ScenarioError(f"{src}: {where}.{key}: unknown key (known: {', '.join(known)})")
        if not _type_ok(value, str(known[key].type)):
            raise ScenarioError(
                f"{src}: {where}.{key}: expected {known[key].type}, got {value!r}"
            )
        kwargs[key] = float(value) if known[key].type.startswith("float") and value is not None else value
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
    p = (base / path).resolve() if not Path(path).is_absolute() else Path(path)
    _require(p.exists(), src, key, f"path does not exist: {p}")
    return str(p)


def _validate(s: Scenario, src: str) -> None:
    _require(s.model.arch in ARCHS, src, "[model].arch", f"must be one of {ARCHS}")
    _require(s.model.dtype in DTYPES, src, "[model].dtype", f"must be one of {DTYPES}")
    _require(s.data.source in ("generated", "jsonl"), src, "[data].source",
             "must be 'generated' or 'jsonl'")
    _require(s.data.source != "jsonl" or s.data.path is not None, src, "[data].path",
             "required when source = 'jsonl'")
    for key in ("rows", "min_chars", "max_chars", "max_seq_len"):
        _require(getattr(s.data, key) > 0, src, f"[data].{key}", "must be positive")
    _require(s.data.min_chars <= s.data.max_chars, src, "[data].min_chars",
             "must not exceed max_chars")
    _require(s.train.steps > 0, src, "[train].steps", "must be positive")
    _require(s.train.global_batch > 0, src, "[train].global_batch", "must be positive")
    _require(s.train.learning_rate > 0, src, "[train].learning_rate", "must be positive")
    _require(s.train.digest_every >= 0, src, "[train].digest_every", "must be >= 0")
    _require(len(s.runs) > 0, src, "[[runs]]", "at least one run is required")
    names = [r.name for r in s.runs]
    _require(len(set(names)) == len(names), src, "[[runs]].name", "run names must be unique")
    for i, r in enumerate(s.runs):
        key = f"[[runs]][{i}].world_size"
        _require(r.world_size >= 1, src, key, f"must be >= 1, got {r.world_size}")
        _require(r.world_size <= s.train.global_batch, src, key,
                 f"{r.world_size} exceeds [train].global_batch {s.train.global_batch}: "
                 "a rank would get no rows")
        _require(r.backend is None or r.backend in BACKENDS, src, f"[[runs]][{i}].backend",
                 f"must be one of {BACKENDS}")
    ref = s.checks.reference
    _require(ref is None or ref in names, src, "[checks].reference",
             f"{ref!r} is not a run name ({', '.join(names)})")
    for key in ("loss_tolerance", "param_tolerance"):
        _require(getattr(s.checks, key) >= 0, src, f"[checks].{key}", "must be >= 0")
    _require(s.limits.wall_s > 0 and s.limits.no_progress_s > 0, src, "[limits]",
             "limits must be positive")
    for i, f in enumerate(s.faults):
        _require(f.action in FAULT_ACTIONS, src, f"[[faults]][{i}].action",
                 f"must be one of {FAULT_ACTIONS}")
        _require(f.step >= 1, src, f"[[faults]][{i}].step", "must be >= 1")


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
    s.model.path = _resolve(s.model.path, base, src, "[model].path")
    s.data.path = _resolve(s.data.path, base, src, "[data].path")
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
