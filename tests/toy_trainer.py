"""The rank side of a toy trainer kind that exists only in the tests (``test_trainer_registry.py``
registers it through an entry point): it trains with the example script's DDP loop
(``examples/ddp_train.py``) and reports through the rank protocol, read back into the reporter every trainer uses."""

from __future__ import annotations

import runpy
from typing import Any

from tests.conftest import EXAMPLE


def run(ctx: Any) -> dict[str, Any]:
    from harness import api
    from harness.rank.protocol import Feed, Writer, protocol_dir, read_outcome
    from harness.rank.reporter import StepReporter
    from harness.scenario import Scenario

    s = Scenario.from_dict(ctx.job["scenario"])
    rep = StepReporter(ctx, s, {"data_share_bytes": "the toy trainer does not say which rows it holds"})
    rep.name = "trainer toy"
    out = protocol_dir(ctx.run_dir, ctx.rank)
    out.mkdir(exist_ok=True)
    feed = Feed(out, rep, rep.name)
    api._activate(api.Session(ctx, s, rep, Writer(out), feed.read))
    rep.start()
    try:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    finally:
        api._activate(None)
    feed.read()
    _, params = read_outcome(out, rep, rep.name)
    return rep.finish(params)
