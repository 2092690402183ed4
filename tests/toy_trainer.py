"""A toy trainer kind that exists only in the tests, in one module: its record (``TRAINER``,
with its own scenario rule) and its rank side (``run``). One line registers it: the entry point
``toy = tests.toy_trainer:TRAINER`` (``test_trainer_registry.py`` ships it as another project
would). It trains with the example script's DDP loop (``examples/ddp_train.py``) and reports
through the rank protocol, read back into the reporter every trainer uses."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

from harness.scenario.spec import RunSpec, Scenario, require
from harness.scenario.trainer_info import TrainerInfo

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ddp_train.py"


def rules(eff: Scenario, run: RunSpec, src: str, where: str) -> None:
    require(eff.train.global_batch % run.world_size == 0, src, f"{where}.world_size",
            "the toy trainer gives every rank the same number of rows")


TRAINER = TrainerInfo("toy", "a toy trainer of the tests", "tests.toy_trainer", probes=True, rules=rules,
                      saves="the toy trainer saves its final parameters on rank 0")


def run(ctx: Any) -> dict[str, Any]:
    from harness.rank import script_session
    from harness.rank.protocol import Feed, Writer, protocol_dir, read_outcome
    from harness.rank.reporter import StepReporter
    from harness.scenario.checks import CheckName

    s = ctx.job.scenario
    rep = StepReporter(ctx, s, {CheckName.data_share_bytes: "the toy trainer does not say which rows it holds"})
    rep.name = f"trainer {TRAINER.kind}"
    out = protocol_dir(ctx.run_dir, ctx.rank)
    out.mkdir(exist_ok=True)
    feed = Feed(out, rep, rep.name)
    session = script_session.Session(ctx, s, rep, Writer(out), feed.read)
    script_session.activate(session)
    rep.start()
    try:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    finally:
        script_session.activate(None)
    feed.read()
    _, params = read_outcome(out, rep, rep.name, params=session.final)  # the script hands them over in memory
    return rep.finish(params)
