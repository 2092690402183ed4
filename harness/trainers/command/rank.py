"""An executable under test as every rank (``[trainer] kind = "command"``), in any language.

The rank process does not join the distributed group: it writes the executable's job (its rows
of each step, the seed, steps, learning rate) into ``rank{r}.protocol/``, starts it with the job
in its environment (``schema.COMMAND_ENV``; mlx.launch's own variables are inherited, so its
``distributed::init`` joins the group), and reads what it writes there as it goes
(``harness.rank.protocol``; docs/rank-protocol.md). Its steps reach the watchdog and the judge
as any trainer's do. An executable that exits non-zero, writes a malformed record or one of
another protocol version, or ends without a result fails the run with one line naming it; it
runs in the rank's process group, so the watchdog's kill reaches it. It may keep a collective
ledger of its own in the file ``schema.COMMAND_ENV["collectives"]`` names (the rank's
``ledger_path``; none is named under ``MLX_DDP_HARNESS_LEDGER=0``), which the controller
compares as a Python rank's (``harness.controller.ledgers``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import schema
from harness.rank.context import RankContext, ReportedFailure
from harness.rank.device_check import current
from harness.rank.ledger import enabled as ledger_enabled
from harness.rank.protocol import open_protocol, problem, read_outcome
from harness.rank.protocol import warm_imports as warm_imports  # a warm-start server's hook
from harness.rank.reporter import StepReporter
from harness.scenario import Scenario
from harness.scenario.checks import STEP_LOCAL, CheckName
from harness.trainers.command import TRAINER

POLL_S = 0.02
MLX_MEMORY = (CheckName.memory_mlx_per_rank_mb, CheckName.memory_mlx_total_mb)
NOT_APPLICABLE = {
    CheckName.data_share_bytes: "the harness cannot see which rows an executable keeps",
    CheckName.global_rng_untouched: "the harness cannot see an executable's random number generators",
    **dict.fromkeys(STEP_LOCAL, "the rank protocol has no step-local probe"),
}


def write_job(ctx: RankContext, s: Scenario, out: Path) -> dict[str, str]:
    """This rank's rows of every step and the job; returns the job as environment variables."""
    from harness.trainers.reference.rank_data import load_data

    split = ctx.job.split_rows or 1
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
           "rows": str(rows_path), "out_dir": str(out), "device": current(),
           "collectives": str(schema.ledger_path(ctx.run_dir, ctx.rank)) if ledger_enabled() else ""}
    assert problem("job", job) is None, problem("job", job)
    (out / schema.COMMAND_FILES["job"]).write_text(json.dumps(job, indent=1) + "\n")
    return {schema.COMMAND_ENV[k]: str(v) for k, v in job.items()}


def ended(proc: subprocess.Popen) -> tuple[int | None, int | None]:
    """The executable's exit code once it has ended (None while it runs), and then its peak RSS in
    bytes as the kernel counted it (``wait4``), which sees what fell between the sampler's reads: a
    fast executable's growth after its last sample counts too (None where the system does not say)."""
    if not hasattr(os, "wait4"):
        return proc.poll(), None
    try:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    except ChildProcessError:  # reaped already
        return proc.poll(), None
    if pid == 0:
        return None, None
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # bytes there, KiB here


def run(ctx: RankContext) -> dict[str, Any]:
    s = ctx.job.scenario
    exe = str(s.trainer.path)
    label = f"command {Path(exe).name} (rank {ctx.rank})"
    rep = StepReporter(ctx, s, NOT_APPLICABLE)
    out, feed = open_protocol(ctx.run_dir, ctx.rank, rep, label)
    env = {**os.environ, **write_job(ctx, s, out)}
    rep.start()
    try:
        proc = subprocess.Popen([exe, *s.trainer.args], env=env)  # its output goes to the rank's files
    except OSError as err:
        raise ReportedFailure(f"{label} could not start: {err}") from None
    if ctx.memory is not None:
        ctx.memory.follow(proc.pid)  # its RSS, from the end of its first step
    try:
        code, peak = ended(proc)
        while code is None:
            feed.read()
            time.sleep(POLL_S)
            code, peak = ended(proc)
        feed.read()
        if ctx.memory is not None and peak:
            ctx.memory.followed_ended(peak)
    finally:
        if proc.poll() is None:  # a malformed event, or the rank interrupted: the executable goes too
            proc.kill()
            proc.wait()
        feed.close()
    _, params = read_outcome(out, rep, label, code)
    finished = rep.finish(params)
    if not feed.mlx_reported:
        finished["not_applicable"].update(dict.fromkeys(MLX_MEMORY, f"{label.split(' (rank')[0]} reports no "
                                                                     f"mlx_peak_bytes in its step events"))
    return {**finished, "trainer": {"kind": TRAINER.kind, "title": label.split(" (rank")[0], "path": exe}}
