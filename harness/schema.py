"""The versioned rank protocol: the only data that crosses the controller/rank boundary.

The controller writes one ``job.json`` into a run directory (a training job names its trainer's
rank-side module and the libraries it hides under ``trainer``: ranks look nothing up). Every rank appends events to
``rank{r}.events.jsonl`` (one JSON object per line, flushed at once so the controller can watch
progress) and finally writes ``rank{r}.result.json`` atomically. Each record carries
``schema_version``; a reader refuses a version it does not know.

Event kinds written by ranks:
  ``start``  rank, world_size, host, pid, device, backend, startup_s, rss_runtime_bytes,
             rss_baseline ("job start", or on CUDA "end of the first step"), rss_baseline_bytes
  ``phase``  name (heartbeat between steps: "model", "data", "train", "save", ...)
  ``step``   step, loss, tokens_global, tokens_local, rows_local, step_time_s,
             mlx_peak_bytes, rss_bytes, [digest], [fetch_s, build_s, eval_s: the step's time
             fetching its batch, building its lazy graph (the reference's on CUDA: with its
             forward's evaluation started) and evaluating it, where a trainer times them],
             [cpu_s: the rank process's CPU time so far, at the step's end (the reference's)],
             [rss_baseline ("end of step N"),
             rss_baseline_bytes: at the step that set a CUDA rank's baseline]
  ``memory`` rank, mlx_active_bytes, mlx_peak_bytes, rss_bytes (sampled while the rank runs,
             written when a figure rose: ``harness.memory.sampler``)
  ``fault``  rank, step, phase, action (an injected fault, just before it acts)
  ``end``    status
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any, TypedDict

SCHEMA_VERSION = 2

JOB_FILE = "job.json"
HOST_ROOT_VAR = "MLX_DDP_HARNESS_ROOT"  # a rank on a cluster host: its run's directory there (``controller.launch``)

# The rank protocol an executable under test speaks (``[trainer] kind = "command"``;
# docs/rank-protocol.md, JSON Schemas in harness/protocol/). Its rank process gives it the job in
# ``COMMAND_ENV`` variables (and the same values in ``job.json`` in its directory) and reads
# what it writes there: events, a result and its final parameters.
COMMAND_PROTOCOL = 1
COMMAND_ENV = {
    "protocol": "MLX_DDP_HARNESS_PROTOCOL", "out_dir": "MLX_DDP_HARNESS_OUT", "rows": "MLX_DDP_HARNESS_ROWS",
    "seed": "MLX_DDP_HARNESS_SEED", "steps": "MLX_DDP_HARNESS_STEPS", "global_batch": "MLX_DDP_HARNESS_GLOBAL_BATCH",
    "learning_rate": "MLX_DDP_HARNESS_LEARNING_RATE", "optimizer": "MLX_DDP_HARNESS_OPTIMIZER",
    "vocab_size": "MLX_DDP_HARNESS_VOCAB_SIZE", "split_rows": "MLX_DDP_HARNESS_SPLIT_ROWS",
    "rank": "MLX_DDP_HARNESS_RANK", "world_size": "MLX_DDP_HARNESS_WORLD_SIZE", "device": "MLX_DDP_HARNESS_DEVICE",
    "collectives": "MLX_DDP_HARNESS_COLLECTIVES",  # where it may append its collective ledger (``ledger_path``)
}
NO_STEPS = "reported no steps"  # a trainer that never trained: every other run of it would say the same

COMMAND_FILES = {"job": "job.json", "rows": "rows.tsv", "events": "events.jsonl", "result": "result.json",
                 "params": "params.safetensors", "start_params": "start.safetensors"}


def after_step(step: int) -> str:
    """Where a rank was, from the last step its events report it finished (for messages)."""
    return f"after step {step}" if step else "before its first step"


class SchemaError(ValueError):
    """A protocol file is missing fields, malformed, or of an unknown schema version."""


def events_path(run_dir: Path | str, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.events.jsonl"


def result_path(run_dir: Path | str, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.result.json"


def stdout_path(run_dir: Path | str, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.stdout"


def stderr_path(run_dir: Path | str, rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.stderr"


def ledger_path(run_dir: Path | str, rank: int) -> Path:
    """A rank's collective ledger (``harness.rank.ledger``): one JSON line per collective call."""
    return Path(run_dir) / f"rank{rank}.collectives.jsonl"


def warm_rusage_path(run_dir: Path | str, rank: int) -> Path:
    """A warm-started rank's resource use (``harness.rank.warm``): ``cpu_s`` and ``maxrss_kb``, as
    the process that forked it waited for it (the launcher never does: it is not its child)."""
    return Path(run_dir) / f"rank{rank}.warm.json"


def warm_server_path(directory: Path | str, key: str, what: str) -> Path:
    """A warm-start server's file (``harness.rank.warm``, ``harness.controller.warm_ranks``):
    ``what`` is ``sock``, ``lock`` (its pid), ``log``, ``job.json`` (what it preloads),
    ``key.json`` (what its key holds) or ``refused`` (why it does not serve)."""
    return Path(directory) / f"{key}.{what}"


def params_path(run_dir: Path | str) -> Path:
    """Final parameters written by rank 0 (safetensors)."""
    return Path(run_dir) / "rank0.params.safetensors"


def start_params_path(run_dir: Path | str) -> Path:
    """The parameters training started from, written by rank 0 (safetensors): how far training
    moved them is what a parameter comparison must be able to tell apart from noise."""
    return Path(run_dir) / "rank0.start.safetensors"


def probe_path(directory: Path | str, step: int) -> Path:
    """A step-local probe (safetensors: parameters and gradient) the reference run records at
    ``step`` and the compared runs read (``harness.rank.step_probe``)."""
    return Path(directory) / f"probe-step-{step:08d}.safetensors"


def write_json_atomic(path: Path | str, data: dict[str, Any]) -> None:
    """Write JSON through a temporary file, fsync and rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def stamp(record: dict[str, Any]) -> dict[str, Any]:
    """Return ``record`` with the schema version added."""
    return {"schema_version": SCHEMA_VERSION, **record}


def check_version(record: dict[str, Any], where: str) -> dict[str, Any]:
    version = record.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SchemaError(f"{where}: schema_version {version!r}, expected {SCHEMA_VERSION}")
    return record


class _RankRequired(TypedDict):
    """What every rank's result holds (``harness.rank.entry``): who it was and how it ended."""

    rank: int
    pid: int
    host: str
    job: str  # the job's kind: "train", or a probe or benchmark job
    status: str  # "ok" or "error" (then ``error`` and ``traceback``)


class RankResult(_RankRequired, total=False):
    error: str
    traceback: str
    world_size: int
    backend: str
    device: str
    is_main: bool
    accelerator: str  # "cpu", "cuda" or "metal"
    device_asked: str  # a training job's ``[train] device``: "auto", "gpu" or "cpu"
    device_reason: str | None  # why it computes there, where auto chose or the device check moved it
    device_check: dict[str, Any]  # device, checks, status (passed, fell_back, skipped), detail
    startup_s: float
    startup_parts_s: dict[str, float]
    startup_total_s: float
    libraries_loaded: list[str]
    preloaded: list[str]  # the LD_PRELOAD libraries mapped into the rank (``harness.rank.startup.preloaded``)
    rss_runtime_bytes: int
    mlx_peak_bytes: int
    rss_peak_bytes: int
    rss_baseline: str
    rss_baseline_bytes: int | None
    rss_peak_after_baseline_bytes: int | None
    memory_sampler_error: str | None
    memory_share: dict[str, Any]  # working set, budget, share, limit calls (``harness.memory.share``)
    ablated: list[str]  # the parts turned off for benchmarks/observer_effect.py (``harness.ablation``)
    alternated: dict[str, int]  # parts run in alternate blocks of this many steps (``harness.ablation``)


class _TrainRequired(TypedDict):
    """What every trainer's rank reports on a training job that ended ``ok`` (the reference
    trainer and ``harness.rank.reporter`` for every other trainer build it with ``train_result``;
    the controller reads it strictly: ``check_train_result``)."""

    trainer: dict[str, Any]  # kind, title (and what the trainer adds)
    steps: int  # the last step trained
    steps_planned: int
    steps_start: int  # the first step this run trained (after a resume: the step after it)
    losses: list[float]  # per step from steps_start: the global loss as the trainer computed it
    step_times_s: list[float]
    tok_s_local: list[float]
    tok_s_global: list[float]
    tokens_local_per_step: list[int]
    tokens_global_per_step: list[int]
    learning_rates: list[float]  # empty where the trainer does not report them
    tokens_local: int
    tokens_global: int
    input_widths: list[int | None]  # the padded input width of each step
    runtime_s: float
    train_time_s_total: float
    resume: dict[str, Any] | None
    digests: dict[str, str]  # step -> parameter digest
    final_digest: str
    param_count: int
    model_config: dict[str, Any] | None  # the model's architecture config (None: the trainer's own model)
    evals: list[dict[str, Any]]  # step, loss, tokens
    stop: dict[str, Any] | None  # a stop agreed between ranks
    compile: dict[str, Any]  # mode, scope, fallback_reason
    side_effects: dict[str, int]  # saves and the like, on this rank
    data: dict[str, Any]  # streaming, rows and bytes held
    rss_step_peak_bytes: int
    seed_used: int
    precision: dict[str, Any]
    global_rng_untouched: bool  # judged from the start of training (``global_rng_changed``: which RNG moved)
    probes: list[dict[str, Any]] | None  # step-local probes (``harness.rank.step_probe``)


class TrainResult(_TrainRequired, total=False):
    grad_norms: list[float | None]
    images_global_per_step: list[int]
    img_s_global: list[float]
    images_local: int
    images_global: int
    vision: dict[str, Any] | None
    stop_after: int | None
    tokens_local_unattributed: int
    segments: list[dict[str, Any]]
    checkpoints: list[dict[str, Any]]
    rows_per_rank_step: int
    per_rank: list[dict[str, Any]]
    host_rank_map: dict[str, list[int]]
    collectives: int
    mutation: str | None
    emulate: int | None
    not_applicable: dict[str, str]  # check -> why the trainer cannot be judged by it
    history_start: int
    from_rank0: dict[str, Any] | None  # figures every rank took from rank 0, and why
    global_rng_changed: list[str]  # the global RNGs training changed ("numpy", "mlx")
    param_count_frozen: int  # the frozen parameters beside the trained ones (a LoRA run's base), where known
    dtype_changes: dict[str, Any] | None  # the parameters whose final dtype is not their start's (``dtype_held``)


def _keys_problem(record: dict[str, Any], *types: Any, closed: bool = True) -> str | None:
    """A key ``types`` require that ``record`` lacks; when ``closed``, also a key none of them knows."""
    required = set().union(*(t.__required_keys__ for t in types))
    known = required.union(*(t.__optional_keys__ for t in types))
    missing, unknown = sorted(required - record.keys()), sorted(record.keys() - known - {"schema_version"})
    if missing:
        return f"lacks {', '.join(missing)}"
    if unknown and closed:
        return f"has unknown keys {', '.join(unknown)}"
    return None


def train_result(**fields: Any) -> TrainResult:
    """A training rank's result, refused (TypeError) when a key is missing or unknown."""
    problem = _keys_problem(fields, TrainResult)
    if problem:
        raise TypeError(f"a training result {problem}")
    return TrainResult(**fields)  # type: ignore[typeddict-item]


def check_rank_result(record: dict[str, Any], where: str) -> dict[str, Any]:
    """A rank's result read strictly: every key its job's kind requires, no key unknown
    (``SchemaError`` naming them); a training job's that ended ``ok`` is a ``TrainResult`` too."""
    train = record.get("job") == "train"  # other jobs (the all-sum job, a benchmark) carry figures of their own
    types = (RankResult, TrainResult) if train and record.get("status") == "ok" else (RankResult,)
    problem = _keys_problem(record, *types, closed=train)
    if problem:
        raise SchemaError(f"{where}: {problem}")
    return record


def read_json(path: Path | str) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SchemaError(f"{path}: unreadable ({e})") from e
    if not isinstance(data, dict):
        raise SchemaError(f"{path}: expected a JSON object")
    return check_version(data, str(path))


class EventWriter:
    """Appends schema-stamped events to a JSONL file, flushing each line; safe to share between
    threads (a rank's memory sampler writes from its own)."""

    def __init__(self, path: Path | str):
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []  # told of each event

    def emit(self, kind: str, **fields: Any) -> None:
        line = json.dumps(stamp({"kind": kind, "time": time.time(), **fields}), sort_keys=True) + "\n"
        with self._lock:
            self._f.write(line)
            self._f.flush()
        for listen in self.listeners:
            listen(kind, fields)

    def close(self) -> None:
        with self._lock:
            self._f.close()


def read_events(path: Path | str) -> Iterator[dict[str, Any]]:
    """Yield complete events; a torn last line (a rank killed mid-write) is ignored."""
    path = Path(path)
    if not path.exists():
        return
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.endswith("\n"):
                return
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SchemaError(f"{path}:{n}: not JSON ({e})") from e
            yield check_version(record, f"{path}:{n}")


@cache
def _protocol_schema(name: str) -> dict[str, Any]:
    return json.loads((Path(__file__).parent / "protocol" / f"{name}.schema.json").read_text())


@cache
def _protocol_validator(name: str, kind: str | None = None) -> Any:
    """The validator of ``name``'s schema; with ``kind``, of the branch its ``allOf`` gives records
    of that ``kind`` (``if`` the kind, ``then`` the branch), which is all the whole schema checks of
    such a record but its ``protocol`` and ``kind``: an event is checked against its own branch
    alone, not against every branch's condition. None where the schema has no branch for ``kind``."""
    import jsonschema

    doc = _protocol_schema(name)
    whole = jsonschema.Draft202012Validator(doc)
    if kind is None:
        return whole
    for branch in doc.get("allOf", ()):
        if branch.get("if", {}).get("properties", {}).get("kind", {}).get("const") == kind:
            return whole.evolve(schema=branch["then"])  # references still resolve against the whole
    return None


def protocol_problem(name: str, record: Any) -> str | None:
    """Why ``record`` is not a valid ``name`` record ("job", "event", "result", "collective") of the
    rank protocol (its JSON Schemas are in ``harness/protocol/``), or None."""
    said = record.get("protocol") if isinstance(record, dict) else COMMAND_PROTOCOL
    if said != COMMAND_PROTOCOL or isinstance(said, bool):  # True == 1 in Python, not in JSON
        return f"protocol {said!r}, the harness speaks {COMMAND_PROTOCOL}"
    kind = record.get("kind") if isinstance(record, dict) else None
    validator = _protocol_validator(name, kind) if isinstance(kind, str) else None
    if validator is not None and validator.is_valid(record):
        return None
    errors = sorted((validator or _protocol_validator(name)).iter_errors(record), key=lambda e: list(e.path))
    if not errors:
        return None
    e = errors[0]
    return f"{'.'.join(map(str, e.path)) or 'the record'}: {e.message}"
