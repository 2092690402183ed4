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
             mlx_peak_bytes, rss_bytes, [digest], [rss_baseline ("end of step N"),
             rss_baseline_bytes: at the step that set a CUDA rank's baseline]
  ``memory`` rank, mlx_active_bytes, mlx_peak_bytes, rss_bytes (sampled while the rank runs,
             written when a figure rose: ``harness.rank.memory``)
  ``fault``  rank, step, phase, action (an injected fault, just before it acts)
  ``end``    status
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2

JOB_FILE = "job.json"


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


def params_path(run_dir: Path | str) -> Path:
    """Final parameters written by rank 0 (safetensors)."""
    return Path(run_dir) / "rank0.params.safetensors"


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

    def emit(self, kind: str, **fields: Any) -> None:
        line = json.dumps(stamp({"kind": kind, "time": time.time(), **fields}), sort_keys=True) + "\n"
        with self._lock:
            self._f.write(line)
            self._f.flush()

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
