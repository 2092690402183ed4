"""Collective mutations: DDP bugs planted in a trainer's gradient all-reduce through the ledger's
interposition (``harness.rank.collective_mutations``), the trainer's code unchanged. A user's
script under the harness (``examples/minimal_script.py``) on real ranks: each mutated run is
caught by a check with a finite margin of at least ``mutation_margin``; the correct run passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.rank.collective_mutations import mutated_all_sum
from harness.scenario import ScenarioError, load_scenario
from harness.scenario.names import COLLECTIVE_MUTATIONS
from tests.conftest import REPO, cli, script_scenario

SCRIPT = (REPO / "examples" / "minimal_script.py").read_text()
RUNS = "".join(f'\n[[runs]]\nname = "{m}"\nworld_size = 2\nmutation = "{m}"\n' for m in COLLECTIVE_MUTATIONS)


def test_each_collective_mutation_changes_what_an_all_sum_returns() -> None:
    import mlx.core as mx

    x = mx.array([1.0, 2.0])

    def summed(y: mx.array) -> mx.array:  # an all-sum with the other rank's 10s
        return y + 10

    got = {m: mutated_all_sum(m, summed, (x,), {}, 1, 2).tolist() for m in COLLECTIVE_MUTATIONS}
    assert got == {"allreduce_skipped": [1.0, 2.0], "allreduce_not_averaged": [22.0, 24.0],
                   "rank_dropped": [10.0, 10.0]}  # rank 1 of 2 is the last: its share is dropped
    with pytest.raises(ValueError, match="unknown collective mutation"):
        mutated_all_sum("nothing", summed, (x,), {}, 0, 2)


def test_a_collective_mutation_is_refused_where_it_cannot_act(tmp_path: Path) -> None:
    ref = (REPO / "scenarios" / "text_parity.toml").read_text() + '\n[[runs]]\nname = "m"\nworld_size = 2\n' \
        'mutation = "allreduce_skipped"\n'
    (tmp_path / "ref.toml").write_text(ref)
    with pytest.raises(ScenarioError, match="all-reduce is its own: its bugs are mean_of_means"):
        load_scenario(tmp_path / "ref.toml")
    script = script_scenario(tmp_path, SCRIPT, "m", extra='\n[[runs]]\nname = "m"\nworld_size = 2\n'
                             'mutation = "same_shard"\n')
    with pytest.raises(ScenarioError, match="takes a collective mutation"):
        load_scenario(script)


def _names_no_na_check(run: str, caught: dict, checks: dict) -> None:
    """A check the trainer cannot support (n/a) neither catches the mutation nor is named beside it."""
    na = [c["name"] for (_, r), c in checks.items() if r == run and c["result"] == "n/a"]
    assert na and not any(name in caught["detail"] for name in na), (na, caught["detail"])


@pytest.mark.ranks
def test_every_collective_mutation_is_caught_in_a_users_script(tmp_path: Path) -> None:
    path = script_scenario(tmp_path, SCRIPT, "script_mutations", world_sizes=(1, 2), extra=RUNS)
    p = cli("run", str(path), "--out", str(tmp_path / "out"))
    (s,) = json.loads((tmp_path / "out" / "result.json").read_text())["scenarios"]
    checks = {(c["name"], c["run"]): c for c in s["checks"]}
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert all(c["passed"] and c["result"] in ("pass", "n/a") for (_, r), c in checks.items() if r == "ddp2")
    for m in COLLECTIVE_MUTATIONS:
        caught = checks[("mutation_caught", m)]
        assert caught["passed"] and caught["value"] >= 10, caught
        print(f"{m}: {caught['detail']}")
        _names_no_na_check(m, caught, checks)
    assert "allreduce_not_averaged" in p.stdout  # the mutation table names each


@pytest.mark.ranks
def test_every_collective_mutation_is_caught_in_mlx_lms_trainer(tmp_path: Path) -> None:
    """mlx-lm's own ``train()`` (compiled, ``average_gradients``), under the default suite's
    ``mlx_lm_lora``: its gradient all-reduce is found from mlx-lm's call site and mutated."""
    path = tmp_path / "mlx_lm_mutations.toml"
    path.write_text((REPO / "scenarios" / "mlx_lm_lora.toml").read_text() + RUNS)
    p = cli("run", str(path), "--out", str(tmp_path / "out"))
    (s,) = json.loads((tmp_path / "out" / "result.json").read_text())["scenarios"]
    checks = {(c["name"], c["run"]): c for c in s["checks"]}
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    for m in COLLECTIVE_MUTATIONS:
        caught = checks[("mutation_caught", m)]
        assert caught["passed"] and caught["value"] >= 10, caught
        print(f"{m}: {caught['detail']}")
        _names_no_na_check(m, caught, checks)
    ledger = (tmp_path / "out" / "runs" / s["name"] / "rank_dropped" / "rank0.collectives.jsonl").read_text()
    assert '"site":"trainer.py:' in ledger and '"mutation":"rank_dropped"' in ledger
