"""Step-local probes under real ranks: they measure, and they leave every trajectory bitwise as it
was, including one whose semantics carry state from step to step (a stale-gradient mutation)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import schema
from harness.controller.ledgers import check_ledger
from harness.controller.scenario_runs import run_plan
from harness.scenario import load_scenario
from harness.scenario.plan import plan_scenario
from tests.conftest import write_scenario

pytestmark = pytest.mark.ranks


def _runs(tmp: Path, name: str, every: int, mutation: str = "") -> dict:
    path = write_scenario(tmp, name, world_sizes=(1, 2), steps=4, checks=f"probe_every = {every}")
    if mutation:
        path.write_text(path.read_text().replace('name = "ddp2"', f'name = "ddp2"\nmutation = "{mutation}"'))
    return {r.name: r for r in run_plan(plan_scenario(load_scenario(path)), artifacts=tmp / f"{name}_runs")}


def probe_collectives(ledger: Path) -> dict[int, int]:
    """How many collectives the defect hypotheses issued at each step (the ledger's call sites)."""
    checked = check_ledger(ledger)
    assert checked is not None and checked[1] is None, checked
    per_step: dict[int, int] = {}
    for e in checked[0]:
        if e["site"].startswith("defects.py"):
            per_step[e["step"]] = per_step.get(e["step"], 0) + 1
    return per_step


@pytest.mark.parametrize("mutation", ["", "stale_gradient"])
def test_probes_leave_the_trajectory_bitwise_unchanged(scenario_dir: Path, mutation: str) -> None:
    probed = _runs(scenario_dir, "probed", 1, mutation)
    plain = _runs(scenario_dir, "plain", 0, mutation)
    for name in ("single", "ddp2"):
        a, b = probed[name].result(), plain[name].result()
        assert a["losses"] == b["losses"] and a["digests"] == b["digests"] and a["final_digest"] == b["final_digest"]
        assert a["grad_norms"] == b["grad_norms"]
    records = [o.result["probes"] for o in probed["ddp2"].ranks]
    assert [p["step"] for p in records[0]] == [1, 2, 3, 4] and not plain["ddp2"].result()["probes"]
    assert probed["single"].result()["side_effects"]["probes"] == 4  # rank 0 of the reference wrote them
    twin = probed["twin2"].ranks[0].result["probes"]  # the floor run: its errors, no defect hypotheses
    assert [p["step"] for p in twin] == [1, 2, 3, 4] and not any("defects" in p for p in twin)
    assert all(set(p["defects"]) >= {"correct", "mean_of_means"} for recs in records for p in recs)
    # every hypothesis's sums over the ranks in one collective (float32 throughout): each waits on the link
    for r in (0, 1):
        assert probe_collectives(schema.ledger_path(scenario_dir / "probed_runs" / "ddp2", r)) == {s: 1 for s in
                                                                                                 (1, 2, 3, 4)}
    if not mutation:
        assert all(p["tokens"] == p["tokens_ref"] and p["grad_rel"] < 1e-5 for recs in records for p in recs)
    else:  # the stale gradient is what the probe sees, every step
        assert all(p["grad_rel"] > 0.1 for recs in records for p in recs)
