"""Collective mutations: DDP bugs planted in a trainer's gradient all-reduce through the ledger's
interposition (``harness.rank.collective_mutations``), the trainer's code unchanged. A user's
script under the harness (``examples/minimal_script.py``) on real ranks: each mutated run is
caught by a check with a finite margin of at least ``mutation_margin``; the correct run passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.controller.outcome import RankOutcome, RunOutcome, WatchReport
from harness.judge.checks import Check
from harness.judge.timed_mutations import rank_failure_named, straggler_passed
from harness.rank.collective_mutations import mutated_all_sum
from harness.scenario import ScenarioError, load_scenario
from harness.scenario.names import COLLECTIVE_MUTATIONS, DATA_MUTATIONS, MUTATION_EXPECTS
from harness.scenario.trainers import trainer_info
from tests.conftest import REPO, SharedRun, cli, needs_unsloth, script_scenario
from tests.test_scenarios import INCONCLUSIVE, MAY_NOT_DECIDE

SCRIPT = (REPO / "examples" / "minimal_script.py").read_text()
RUNS = "".join(f'\n[[runs]]\nname = "{m}"\nworld_size = 2\nmutation = "{m}"\n' for m in COLLECTIVE_MUTATIONS)


def test_each_collective_mutation_changes_what_an_all_sum_returns() -> None:
    import mlx.core as mx

    x = mx.array([1.0, 2.0])

    def summed(y: mx.array) -> mx.array:  # an all-sum with the other rank's 10s
        return y + 10

    got = {m: mutated_all_sum(m, summed, (x,), {}, 1, 2).tolist() for m in COLLECTIVE_MUTATIONS}
    assert got == {"allreduce_skipped": [1.0, 2.0], "allreduce_not_averaged": [22.0, 24.0],
                   "rank_dropped": [10.0, 10.0],  # rank 1 of 2 is the last: its share is dropped
                   "straggler": [11.0, 12.0], "rank_killed": [11.0, 12.0]}  # these change when, not what
    with pytest.raises(ValueError, match="unknown collective mutation"):
        mutated_all_sum("nothing", summed, (x,), {}, 0, 2)


def _ranks(times: dict[int, list[float]], fault: dict | None) -> list[RankOutcome]:
    out = []
    for r, ts in times.items():
        events = [{"kind": "step", "step": k, "step_time_s": t} for k, t in enumerate(ts, start=1)]
        if fault is not None and fault["rank"] == r:
            events.append(fault)
        out.append(RankOutcome(r, 0, False, {"status": "ok"}, events, ""))
    return out


def test_a_straggler_passes_only_when_nothing_else_failed_and_the_wait_shows() -> None:
    delay = {"kind": "fault", "phase": "collective", "action": "delay", "rank": 1, "step": 2, "seconds": 1.5,
             "site": "train.py:9 in step"}
    waited = {0: [0.5, 1.6, 0.1, 0.1, 0.1], 1: [0.5, 1.6, 0.1, 0.1, 0.1]}
    run = RunOutcome("straggler", 2, "ring", True, None, _ranks(waited, delay), WatchReport(3.0, 0))
    ok = straggler_passed(run, "straggler", [Check("loss_parity", "straggler", True, 1e-7, 1e-5)])
    assert ok.passed and ok.value == pytest.approx(1.5) and "rank 0 waited 1.50 s" in ok.detail, ok.detail
    false_alarm = straggler_passed(run, "straggler", [Check("loss_parity", "straggler", False, 1e-3, 1e-5)])
    assert not false_alarm.passed and "but loss_parity failed" in false_alarm.detail
    unseen = RunOutcome("straggler", 2, "ring", True, None, _ranks({0: [0.5, 0.1, 0.1, 0.1, 0.1], 1: [0.5] * 5},
                                                                     delay), WatchReport(3.0, 0))
    assert not straggler_passed(unseen, "straggler", []).passed
    never = RunOutcome("straggler", 2, "ring", True, None, _ranks(waited, None), WatchReport(3.0, 0))
    assert "the delay never acted" in straggler_passed(never, "straggler", []).detail


def test_a_killed_rank_passes_only_when_the_run_names_it_first() -> None:
    kill = {"kind": "fault", "phase": "collective", "action": "sigkill", "rank": 1, "step": 2, "time": 100.0,
            "site": "train.py:9 in step"}
    ranks = _ranks({0: [0.1], 1: [0.1]}, kill)

    def run(failure: str | None) -> RunOutcome:
        return RunOutcome("rank_killed", 2, "ring", failure is None, failure, ranks,
                          WatchReport(3.0, 1, named_at=100.4))

    named = rank_failure_named(run("rank 1 ended with signal SIGKILL after step 1\nrank 0 ended with signal SIGTERM"),
                               "rank_killed")
    assert named.passed and named.value == pytest.approx(0.4)
    assert "named as the failing rank 0.4 s after" in named.detail
    for failure in ("rank 0 failed: RuntimeError: boom\nrank 1 ended with signal SIGKILL after step 1",
                    "watchdog: no progress from any rank for 60 s; process group killed", None):
        assert not rank_failure_named(run(failure), "rank_killed").passed, failure


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


def _shows_its_power(s: dict, stdout: str, undecided: frozenset[str] = frozenset()) -> dict:
    """Every collective mutation of ``[checks] mutations = "collectives"`` did what it must, in
    result.json's ``mutations`` and in the printed table; the correct runs passed every check
    (those ``undecided`` are INCONCLUSIVE: without power, tests/test_scenarios.py's INCONCLUSIVE)."""
    checks = {(c["name"], c["run"]): c for c in s["checks"]}
    correct = [c for (_, r), c in checks.items() if r in ("single", "ddp2")]
    assert correct and all(c["passed"] and c["result"] in ("pass", "n/a") or
                           c["name"] in undecided and c["result"] == "INCONCLUSIVE" for c in correct)
    got = {m["mutation"]: m for m in s["mutations"]}
    assert list(got)[:len(COLLECTIVE_MUTATIONS)] == list(COLLECTIVE_MUTATIONS)
    assert set(list(got)[len(COLLECTIVE_MUTATIONS):]) <= set(DATA_MUTATIONS)
    for m, record in got.items():
        print(f"{m}: {record['outcome']} by {record['by']} {record['value']} / {record['limit']}: {record['detail']}")
        assert record["passed"], record
        if m in MUTATION_EXPECTS:
            continue
        caught = checks[("mutation_caught", m)]
        assert record["outcome"] == "caught" and caught["value"] >= 10 and record["margin"] >= 10, record
        _names_no_na_check(m, caught, checks)
    wait = got["straggler"]
    assert wait["outcome"] == "passed" and wait["value"] >= 0.75 and "rank 0 waited" in wait["detail"]
    killed = got["rank_killed"]
    assert killed["outcome"] == "rank named" and "rank 1 ended with signal SIGKILL" in killed["detail"]
    assert not next(r for r in s["runs"] if r["name"] == "rank_killed")["ok"]
    for m in COLLECTIVE_MUTATIONS:
        assert any(line.startswith(m + " ") for line in stdout.splitlines()), m  # a row of the mutation table
    return checks


@pytest.mark.ranks
def test_every_collective_mutation_shows_its_power_in_a_users_script(tmp_path: Path) -> None:
    """``[checks] mutations = "collectives"`` on a script: one run per mutation, copied from ddp2."""
    path = script_scenario(tmp_path, SCRIPT, "script_mutations", world_sizes=(1, 2))
    opt_in = 'reference = "single"\nmutations = "collectives"\n'
    path.write_text(path.read_text().replace('reference = "single"\n', opt_in))
    assert [r.name for r in load_scenario(path).runs] == ["single", "ddp2", *COLLECTIVE_MUTATIONS]
    p = cli("run", str(path), "--out", str(tmp_path / "out"))
    (s,) = json.loads((tmp_path / "out" / "result.json").read_text())["scenarios"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    checks = _shows_its_power(s, p.stdout)
    # the script hands over its step with run.probe: the skipped all-reduce is seen at the reference's
    # parameters and named for what it is
    grad = checks[("step_grad_parity", "allreduce_skipped")]
    assert grad["result"] == "caught" and grad["defect"] == "no_allreduce_global", grad["detail"]


POWER = {  # the power set: each default-suite trainer's scenario with every collective mutation
    "mlx_lm_lora": "trainer.py:",  # mlx-lm's train(), compiled, average_gradients: the straggler and the
    "mlx_vlm_parity": "utils.py:",  # kill act as its compiled step is called; mlx-vlm's Trainer;
    "unsloth_compiled": "trainer.py:",  # unsloth-zoo's compiled local gradient with an eager all-reduce;
    "script_example": "ddp_train.py:",  # a script with its own average_gradients
}


@pytest.mark.ranks
@pytest.mark.full  # twice a shipped scenario's cost each; the reference's and a script's power are shown above
@pytest.mark.parametrize("name", sorted(POWER))
def test_the_power_set_shows_every_collective_mutation_in_each_trainer(name: str, shared_run: SharedRun) -> None:
    """``mlx-ddp-harness run scenarios/power``, one scenario each: every mutation planted in that
    trainer's own gradient all-reduce, found from its own call site. (The shipped scenario's test,
    ``tests/test_scenarios.py``, reads the same run for the runs the two plan alike.)"""
    if name.startswith("unsloth_"):
        needs_unsloth()
    p, out = shared_run(str(REPO / "scenarios" / "power" / f"{name}.toml"))
    (s,) = json.loads((out / "result.json").read_text())["scenarios"]
    undecided = frozenset(INCONCLUSIVE.get(name, set()) | MAY_NOT_DECIDE.get(name, set()))
    said = any(c["result"] == "INCONCLUSIVE" for c in s["checks"])
    assert p.returncode == (4 if said or name in INCONCLUSIVE else 0), p.stdout[-3000:] + p.stderr[-2000:]
    _shows_its_power(s, p.stdout, undecided)
    ledger = (out / "runs" / s["name"] / "rank_dropped" / "rank0.collectives.jsonl").read_text()
    assert f'"site":"{POWER[name]}' in ledger and '"mutation":"rank_dropped"' in ledger


def test_every_power_scenario_extends_a_default_one_and_plans_every_mutation() -> None:
    shipped = {p.stem for p in (REPO / "scenarios" / "power").glob("*.toml")}
    assert shipped == set(POWER)
    for name in POWER:
        s = load_scenario(REPO / "scenarios" / "power" / f"{name}.toml")
        base = load_scenario(REPO / "scenarios" / f"{name}.toml")
        assert (base.default or base.full) and s.default  # mlx_lm_lora: the full set (it may not decide)
        fed = tuple(DATA_MUTATIONS) if trainer_info(s.trainer.kind).feeds_rows else ()
        assert [r.mutation for r in s.runs if r.mutation] == [*COLLECTIVE_MUTATIONS, *fed]
