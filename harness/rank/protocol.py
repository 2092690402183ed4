"""Both sides of the rank protocol (docs/rank-protocol.md): ``Writer``, what a trainer writes
(``harness.api`` writes through it; an executable under test writes the same files itself), and
``Feed`` / ``read_outcome``, how its rank process reads them into the rank's ``StepReporter``,
each record checked against the protocol's JSON Schemas (``harness/protocol``)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any, BinaryIO

from harness import schema
from harness.rank.context import ReportedFailure
from harness.schema import protocol_problem as problem

FILES = schema.COMMAND_FILES


def warm_imports(scenario: Any) -> None:
    """What a rank imports when it checks its first protocol record (an executable's job, a
    script's first event): jsonschema (a warm-start server's import for the script and command
    trainers, ``harness.rank.entry.warm_imports``)."""
    import jsonschema  # noqa: F401


def protocol_dir(run_dir: Path | str, rank: int) -> Path:
    """Where rank ``rank``'s trainer reads its job and writes its records (kept under ``--out``)."""
    return Path(run_dir) / f"rank{rank}.protocol"


def open_protocol(run_dir: Path | str, rank: int, rep: Any, label: str) -> tuple[Path, Feed]:
    """Rank ``rank``'s protocol directory, made, and the ``Feed`` that hands its events to ``rep``
    (a ``StepReporter``, which names the trainer ``label`` in its failures)."""
    out = protocol_dir(run_dir, rank)
    out.mkdir(exist_ok=True)
    rep.name = label
    return out, Feed(out, rep, label)


class Writer:
    """Writes one rank's protocol records into ``out``: events appended and flushed, the final
    parameters, and the result last (atomically)."""

    def __init__(self, out: Path):
        self.out = out
        self._events = open(out / FILES["events"], "a", buffering=1)

    def event(self, kind: str, **fields: Any) -> None:
        self._events.write(json.dumps({"protocol": schema.COMMAND_PROTOCOL, "kind": kind, **fields}) + "\n")
        self._events.flush()

    def params(self, tree: Any, name: str = "params") -> None:
        """A parameter tree into the protocol's ``name`` file ("params", or "start_params")."""
        from harness.rank.host_read import write_safetensors

        write_safetensors(self.out / FILES[name], tree)

    def result(self, **fields: Any) -> None:
        self._events.close()
        schema.write_json_atomic(self.out / FILES["result"], {"protocol": schema.COMMAND_PROTOCOL, **fields})


class Feed:
    """Reads a trainer's events as they are appended and hands each to ``rep`` (a ``StepReporter``)."""

    def __init__(self, out: Path, rep: Any, label: str):
        self.path, self.rep, self.label = out / FILES["events"], rep, label
        self.offset, self.line = 0, 0
        self.mlx_reported = False  # a step event carried the trainer's MLX peak memory
        self._f: BinaryIO | None = None  # the events file, once it exists (appended to, never replaced)

    def read(self) -> None:
        if self._f is None:
            try:
                self._f = open(self.path, "rb")
            except FileNotFoundError:
                return
        self._f.seek(self.offset)
        chunk = self._f.read()
        end = chunk.rfind(b"\n") + 1  # complete lines only; the rest is read when it is finished
        self.offset += end
        for raw in chunk[:end].splitlines():
            self.line += 1
            self.take(raw)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def take(self, raw: bytes) -> None:
        where = f"{self.label} wrote a malformed event ({FILES['events']} line {self.line})"
        try:
            e = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ReportedFailure(f"{where}: not JSON ({err})") from None
        why = problem("event", e)
        if why is not None:
            raise ReportedFailure(f"{where}: {why}")
        if e["kind"] == "step":
            memory = self.rep.ctx.memory
            if "mlx_peak_bytes" in e and memory is not None and memory.followed is not None:
                memory.reported(e["mlx_peak_bytes"])
                self.mlx_reported = True
            self.rep.step(e["step"], e["loss"], e["tokens_global"], e["tokens_local"], lr=e.get("lr"),
                          step_time_s=e.get("step_time_s"), digest=e.get("digest"))
        elif e["kind"] == "eval":
            self.rep.eval(e["step"], e["loss"], e["tokens"])
        elif e["kind"] == "start":
            if "dtype" in e:
                self.rep.saw_dtype(e["dtype"])
            if "digest" in e or "dtypes" in e:
                saved = self.path.parent / FILES["start_params"]
                self.rep.starting(digest=e.get("digest"), saved=saved if saved.exists() else None,
                                  dtypes=e.get("dtypes"))


def exit_words(code: int) -> str:
    return f"ended with signal {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


def read_outcome(out: Path, rep: Any, label: str, code: int = 0, params: Any = None) -> tuple[dict[str, Any], Any]:
    """The trainer's result and final parameters (``params``, where a script in the rank's process
    handed them over in memory; else its parameter file), after it ended with exit ``code`` and
    every event was fed; ``ReportedFailure`` naming ``label`` where either is missing or malformed."""
    path = out / FILES["result"]
    if not path.exists():
        if code != 0:
            raise ReportedFailure(f"{label} {exit_words(code)} without a result")
        raise ReportedFailure(f"{label} exited 0 without writing {FILES['result']}")
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ReportedFailure(f"{label} wrote a malformed {FILES['result']}: not JSON ({err})") from None
    why = problem("result", result)
    if why is not None:
        raise ReportedFailure(f"{label} wrote a malformed {FILES['result']}: {why}")
    if result["status"] != "ok":
        raise ReportedFailure(f"{label} failed: {result['error']}")
    if code != 0:
        raise ReportedFailure(f"{label} {exit_words(code)} after writing a result")
    if result["steps"] != rep.steps:
        raise ReportedFailure(f"{label} wrote a result of {result['steps']} steps after reporting {rep.steps}")
    if result.get("saves"):
        rep.saved(result["saves"])
    if params is not None:
        return result, params
    params_path = out / FILES["params"]
    if not params_path.exists():
        raise ReportedFailure(f"{label} wrote no {FILES['params']} (its final parameters)")
    import mlx.core as mx

    return result, mx.load(str(params_path))
