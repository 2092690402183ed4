"""A user's own training script under test (``[trainer] kind = "script"``).

The script runs as ``__main__`` inside each rank process, with its own directory first on
``sys.path`` and ``[trainer].args`` as its command line, and reports through ``harness.api``,
which writes the rank protocol's records; they are read back as an executable's are, all but its
final parameters, which it hands over in memory. A script that raises, exits non-zero, reports
no step or never hands over its final parameters fails the run with a one-line cause naming the
script.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

from harness import schema
from harness.rank import script_session
from harness.rank.context import RankContext, ReportedFailure
from harness.rank.protocol import FILES, Writer, open_protocol, read_outcome
from harness.rank.protocol import warm_imports as warm_imports  # a warm-start server's hook
from harness.rank.reporter import StepReporter
from harness.scenario.checks import STEP_LOCAL, CheckName
from harness.trainers.script import TRAINER

NOT_PROBED = ("the script hands over no loss-and-gradient function (harness.api: run.probe(step, model, fn, "
              "batch) before each update)")
NOT_APPLICABLE = {
    CheckName.data_share_bytes: "the harness cannot see which rows a script holds",
}
NOT_STARTED = ("the script never said what training starts from (harness.api: run.split(model), or "
               "run.start(params) before the first step)")
UNSTARTED = {CheckName.start_parity: NOT_STARTED,
             CheckName.global_rng_untouched: f"{NOT_STARTED}, so building its model cannot be told from training",
             CheckName.dtype_held: f"{NOT_STARTED}, so the dtypes its weights started in are not known"}


def run(ctx: RankContext) -> dict[str, Any]:
    s = ctx.job.scenario
    path = str(s.trainer.path)
    label = f"trainer script {Path(path).name}"
    rep = StepReporter(ctx, s, NOT_APPLICABLE)
    rep.rng_from_start = True  # the global RNGs are judged from the start of training, not the model's build
    argv, syspath = list(sys.argv), list(sys.path)
    sys.argv = [path, *s.trainer.args]
    sys.path.insert(0, str(Path(path).parent))
    out, feed = open_protocol(ctx.run_dir, ctx.rank, rep, label)
    session = script_session.Session(ctx, s, rep, Writer(out), feed.read)
    script_session.activate(session)
    rep.start()
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):  # sys.exit("why") exits with status 1 and says why
            said = f"status {e.code}" if isinstance(e.code, int) else f"status 1: {e.code}"
            raise ReportedFailure(f"{label} exited with {said}") from e
    except ReportedFailure:
        raise
    except Exception as e:
        raise ReportedFailure(f"{label} raised {type(e).__name__}: {e}") from e
    finally:
        sys.argv, sys.path = argv, syspath
        script_session.activate(None)
    feed.read()
    feed.close()
    if not (out / FILES["result"]).exists():
        if not rep.steps:
            how = ("it never called harness.api.session(): see docs/scripts.md" if not session.used else
                   "call harness.api.session().step(...) once per optimizer step")
            raise ReportedFailure(f"{label} {schema.NO_STEPS} ({how})")
        raise ReportedFailure(f"{label} never handed over its final parameters "
                              f"(call harness.api.session().finish(params))")
    _, params = read_outcome(out, rep, label, params=session.final)
    finished = rep.finish(params)
    if not rep.probe_offered:
        finished["not_applicable"].update(dict.fromkeys(STEP_LOCAL, NOT_PROBED))
    if not session.started:
        finished["not_applicable"].update(UNSTARTED)
    return {**finished, "model_config": session.model_config,  # None: the script's own model
            "trainer": {"kind": TRAINER.kind, "title": label, "path": path}}
