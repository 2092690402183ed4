"""An executable under test as every rank (``[trainer] kind = "command"``), in any language.

The rank process does not join the distributed group: it writes the executable's job (its rows
of each step, the seed, steps, learning rate) into ``rank{r}.command/``, starts it with the job
in its environment (``schema.COMMAND_ENV``; mlx.launch's own variables are inherited, so its
``distributed::init`` joins the group), and reads what it writes there as it goes, each record
checked against the protocol's JSON Schemas (``harness/protocol``; docs/rank-protocol.md). Its
steps reach the watchdog and the judge as any trainer's do. An executable that exits non-zero,
writes a malformed record or one of another protocol version, or ends without a result fails
the run with one line naming it; it runs in the rank's process group, so the watchdog's kill
reaches it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from functools import cache
from pathlib import Path
from typing import Any

from harness import schema
from harness.rank.entry import RankContext, ReportedFailure
from harness.rank.reporter import StepReporter
from harness.scenario import Scenario

POLL_S = 0.02
NOT_APPLICABLE = {
    "data_share_bytes": "the harness cannot see which rows an executable keeps",
    "global_rng_untouched": "the harness cannot see an executable's random number generators",
    **dict.fromkeys(("memory_rss_per_rank_mb", "memory_rss_total_mb", "memory_mlx_per_rank_mb",
                     "memory_mlx_total_mb"), "the rank protocol carries no memory figures yet"),
    **dict.fromkeys(("step_token_parity", "step_loss_parity", "step_grad_parity"),
                    "the rank protocol has no step-local probe"),
}


@cache
def _validator(name: str) -> Any:
    import jsonschema

    doc = json.loads((Path(__file__).parent.parent / "protocol" / f"{name}.schema.json").read_text())
    return jsonschema.Draft202012Validator(doc)


def problem(name: str, record: Any) -> str | None:
    """Why ``record`` is not a valid ``name`` record ("job", "event", "result"), or None."""
    if isinstance(record, dict) and record.get("protocol") != schema.COMMAND_PROTOCOL:
        return f"protocol {record.get('protocol')!r}, the harness speaks {schema.COMMAND_PROTOCOL}"
    errors = sorted(_validator(name).iter_errors(record), key=lambda e: list(e.path))
    if not errors:
        return None
    e = errors[0]
    return f"{'.'.join(map(str, e.path)) or 'the record'}: {e.message}"


def write_job(ctx: RankContext, s: Scenario, out: Path) -> dict[str, str]:
    """This rank's rows of every step and the job; returns the job as environment variables."""
    from harness.trainers.reference.rank_data import load_data

    split = int(ctx.job.get("split_rows") or 1)
    data = load_data(s, ctx.rank, ctx.world_size)
    rows_path = out / schema.COMMAND_FILES["rows"]
    with open(rows_path, "w") as f:
        for step in range(1, s.train.steps + 1):
            for micro in data.train.micro_batches(step):
                for _, e in micro:
                    f.write(f"{step}\t{' '.join(map(str, e.ids.tolist()))}\t"
                            f"{' '.join(str(int(m)) for m in e.supervised.tolist())}\n")
    job = {"protocol": schema.COMMAND_PROTOCOL, "rank": ctx.rank, "world_size": ctx.world_size, "seed": s.seed,
           "steps": s.train.steps, "global_batch": s.train.global_batch, "learning_rate": s.train.learning_rate,
           "optimizer": s.train.optimizer, "vocab_size": data.tok.vocab_size, "split_rows": split,
           "rows": str(rows_path), "out_dir": str(out)}
    assert problem("job", job) is None, problem("job", job)
    (out / schema.COMMAND_FILES["job"]).write_text(json.dumps(job, indent=1) + "\n")
    return {schema.COMMAND_ENV[k]: str(v) for k, v in job.items()}


class Feed:
    """Reads the executable's events as they are appended and hands each to the reporter."""

    def __init__(self, path: Path, rep: StepReporter, label: str):
        self.path, self.rep, self.label = path, rep, label
        self.offset, self.line = 0, 0

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1  # complete lines only; the rest is read when it is finished
        self.offset += end
        for raw in chunk[:end].splitlines():
            self.line += 1
            self.take(raw)

    def take(self, raw: bytes) -> None:
        where = f"{self.label} wrote a malformed event ({schema.COMMAND_FILES['events']} line {self.line})"
        try:
            e = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ReportedFailure(f"{where}: not JSON ({err})") from None
        why = problem("event", e)
        if why is not None:
            raise ReportedFailure(f"{where}: {why}")
        if e["kind"] == "step":
            self.rep.step(e["step"], e["loss"], e["tokens_global"], e["tokens_local"], lr=e.get("lr"),
                          step_time_s=e.get("step_time_s"))
        elif e["kind"] == "eval":
            self.rep.eval(e["step"], e["loss"], e["tokens"])


def _exit_words(code: int) -> str:
    return f"ended with signal {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


def _read_result(path: Path, label: str, code: int) -> dict[str, Any]:
    if not path.exists():
        if code != 0:
            raise ReportedFailure(f"{label} {_exit_words(code)} without a result")
        raise ReportedFailure(f"{label} exited 0 without writing {schema.COMMAND_FILES['result']}")
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ReportedFailure(f"{label} wrote a malformed {schema.COMMAND_FILES['result']}: not JSON ({err})") from None
    why = problem("result", result)
    if why is not None:
        raise ReportedFailure(f"{label} wrote a malformed {schema.COMMAND_FILES['result']}: {why}")
    if result["status"] != "ok":
        raise ReportedFailure(f"{label} failed: {result['error']}")
    if code != 0:
        raise ReportedFailure(f"{label} {_exit_words(code)} after writing a result")
    return result


def run(ctx: RankContext) -> dict[str, Any]:
    s = Scenario.from_dict(ctx.job["scenario"])
    exe = str(s.trainer.path)
    label = f"command {Path(exe).name} (rank {ctx.rank})"
    rep = StepReporter(ctx, s, NOT_APPLICABLE)
    rep.name = label
    out = Path(ctx.run_dir) / f"rank{ctx.rank}.command"
    out.mkdir(exist_ok=True)
    env = {**os.environ, **write_job(ctx, s, out)}
    feed = Feed(out / schema.COMMAND_FILES["events"], rep, label)
    rep.start()
    try:
        proc = subprocess.Popen([exe, *s.trainer.args], env=env)  # its output goes to the rank's files
    except OSError as err:
        raise ReportedFailure(f"{label} could not start: {err}") from None
    try:
        while (code := proc.poll()) is None:
            feed.read()
            time.sleep(POLL_S)
        feed.read()
    finally:
        if proc.poll() is None:  # a malformed event, or the rank interrupted: the executable goes too
            proc.kill()
            proc.wait()
    result = _read_result(out / schema.COMMAND_FILES["result"], label, code)
    if result["steps"] != rep.steps:
        raise ReportedFailure(f"{label} wrote a result of {result['steps']} steps after reporting {rep.steps}")
    if result.get("saves"):
        rep.saved(result["saves"])
    params_path = out / schema.COMMAND_FILES["params"]
    if not params_path.exists():
        raise ReportedFailure(f"{label} wrote no {schema.COMMAND_FILES['params']} (its final parameters)")
    import mlx.core as mx

    params = mx.load(str(params_path))
    return {**rep.finish(params), "trainer": {"kind": "command", "title": label.split(" (rank")[0], "path": exe}}
