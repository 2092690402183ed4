"""The bisection's bookkeeping (``harness.judge.bisection``) and a check's verdict gated across
two sides (``harness.judge.gates.check_gates``), in pure logic; ``tests/test_gate_bisect.py``
runs ``gate --bisect`` on real ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.judge.bisection import BAD, GOOD, UNDECIDED, UNTESTABLE, Bisection, Budget, Commit, Probe
from harness.judge.gates import check_gates


def _commits(n: int) -> list[Commit]:
    return [Commit(f"{i:040x}", f"commit {i}") for i in range(n + 1)]


def _run(commits: list[Commit], outcome_of, alpha: float = 0.02) -> Bisection:  # noqa: ANN001
    b = Bisection(commits, Budget(len(commits) - 1, alpha))
    while (i := b.next_index()) is not None:
        b.record(Probe(i, commits[i], outcome_of(i), "m", "f", 4))
    return b


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 20])
def test_the_first_bad_commit_is_found_wherever_it_is_within_the_probes_budgeted(n: int) -> None:
    commits = _commits(n)
    for first_bad in range(1, n + 1):
        b = _run(commits, lambda i, fb=first_bad: BAD if i >= fb else GOOD)
        a = b.answer()
        assert a.kind == "found" and a.first_bad == commits[first_bad] and a.last_good == commits[first_bad - 1]
        assert b.probes[0].index == n  # BAD is confirmed first
        assert len(b.probes) <= b.budget.probes - b.budget.spare


def test_a_range_that_does_not_regress_ends_after_one_probe() -> None:
    commits = _commits(9)
    b = _run(commits, lambda i: GOOD)
    assert len(b.probes) == 1 and b.answer().kind == "none"


def test_an_undecided_or_untestable_bad_cannot_be_bisected() -> None:
    for outcome in (UNDECIDED, UNTESTABLE):
        b = _run(_commits(5), lambda i, o=outcome: o)
        assert len(b.probes) == 1 and b.answer().kind == "undecided"


def test_commits_set_aside_leave_a_range_never_a_guess() -> None:
    commits = _commits(8)
    # the first bad is 5; 4 cannot be tested: 3 good, 5 bad, so the answer is 4 or 5
    b = _run(commits, lambda i: UNTESTABLE if i == 4 else BAD if i >= 5 else GOOD)
    a = b.answer()
    assert a.kind == "range" and a.candidates == [commits[4], commits[5]] and a.last_good == commits[3]
    assert any(p.index == 4 and p.outcome == UNTESTABLE for p in b.probes)
    # a probe that could not decide is set aside the same way
    b = _run(commits, lambda i: UNDECIDED if i == 4 else BAD if i >= 5 else GOOD)
    assert b.answer().candidates == [commits[4], commits[5]]


def test_the_false_alarm_rate_is_split_over_the_most_probes_and_a_bisection_stops_when_they_are_spent() -> None:
    budget = Budget(8, 0.02)
    assert budget.probes == 1 + 3 + budget.spare and budget.per_probe == pytest.approx(0.02 / budget.probes)
    # every commit but BAD undecided: it stops at the budget with the range left
    commits = _commits(30)
    b = _run(commits, lambda i: BAD if i == 30 else UNDECIDED)
    assert len(b.probes) == b.budget.probes and "probes" in b.stopped
    a = b.answer()
    assert a.kind == "range" and a.candidates[-1] == commits[30] and a.first_bad is None


def test_a_probe_outcome_is_one_of_four() -> None:
    with pytest.raises(ValueError, match="outcome"):
        Probe(0, _commits(1)[0], "maybe")


def _doc(checks: list[tuple[str, str, str]]) -> tuple[Path, dict]:
    return Path("r.json"), {"scenarios": [{"name": "s", "checks": [
        {"name": n, "run": r, "result": res, "value": 0.5, "limit": 0.1} for n, r, res in checks]}]}


def test_a_check_that_passed_at_the_baseline_and_fails_at_the_candidate_fails_its_gate() -> None:
    base = [_doc([("loss_parity", "ddp2", "pass"), ("param_parity", "ddp2", "pass"), ("resume_x", "ddp2", "FAIL")])] * 2
    same = [_doc([("loss_parity", "ddp2", "pass"), ("param_parity", "ddp2", "pass"), ("resume_x", "ddp2", "FAIL")])] * 2
    (g,) = check_gates(base, same)
    assert g.result == "pass" and g.current == "0 of 2 fail"  # a check failing at the baseline is not gated
    flipped = [_doc([("loss_parity", "ddp2", "FAIL"), ("param_parity", "ddp2", "pass")])] * 2
    (g,) = check_gates(base, flipped)
    assert g.result == "FAIL" and g.metric == "checks" and "loss_parity: 0.5 against limit 0.1" in g.detail
    mixed = [flipped[0], same[0]]
    (g,) = check_gates(base, mixed)
    assert g.result == "INCONCLUSIVE" and not g.passed and "(1 of 2 runs)" in g.detail


def test_a_check_that_passed_at_the_baseline_and_is_not_judged_at_the_candidate_is_inconclusive() -> None:
    """A check that stops deciding (n/a, INCONCLUSIVE without power, an expected failure's result)
    cannot be said to hold: its gate neither passes nor fails, naming it with each result seen and
    the first reason given; a check that fails besides still fails the gate."""
    from harness.present.gate_report import CHECKS_UNDECIDED, CHECKS_UNJUDGED, undecided_advice

    base = [_doc([("loss_parity", "ddp2", "pass"), ("param_parity", "ddp2", "pass")]) for _ in range(2)]
    for first, second in (("n/a", "n/a"), ("INCONCLUSIVE", "INCONCLUSIVE"), ("n/a", "INCONCLUSIVE"),
                          ("inconclusive", "inconclusive")):
        cand = [_doc([("loss_parity", "ddp2", "pass"), ("param_parity", "ddp2", r)]) for r in (first, second)]
        cand[1][1]["scenarios"][0]["checks"][1]["detail"] = "no probe step ran"  # the second run's reason only
        (g,) = check_gates(base, cand)
        assert g.result == "INCONCLUSIVE" and not g.passed and g.current == "0 of 2 fail, 1 not judged"
        results = "/".join(sorted({first, second}))
        assert g.detail == f"param_parity: passed at the baseline, {results} here (2 of 2 runs): no probe step ran"
        assert (g.unjudged, g.flaky) == (("param_parity",), ())
        assert undecided_advice([g]) == [CHECKS_UNJUDGED]
    some = [_doc([("loss_parity", "ddp2", "pass"), ("param_parity", "ddp2", r)]) for r in ("n/a", "pass")]
    (g,) = check_gates(base, some)
    assert g.result == "INCONCLUSIVE" and g.detail == "param_parity: passed at the baseline, n/a here (1 of 2 runs)"
    flaky = [_doc([("loss_parity", "ddp2", r), ("param_parity", "ddp2", "n/a")]) for r in ("FAIL", "pass")]
    (g,) = check_gates(base, flaky)
    assert (g.result, g.flaky, g.unjudged) == ("INCONCLUSIVE", ("loss_parity",), ("param_parity",))
    assert undecided_advice([g]) == [CHECKS_UNDECIDED, CHECKS_UNJUDGED]
    both = [_doc([("loss_parity", "ddp2", "FAIL"), ("param_parity", "ddp2", "n/a")]) for _ in range(2)]
    (g,) = check_gates(base, both)
    assert g.result == "FAIL" and "loss_parity: 0.5 against limit 0.1" in g.detail and "param_parity" in g.detail


def test_a_check_a_commit_does_not_judge_decides_nothing_in_a_bisection_and_is_named() -> None:
    """The same at every later commit, an unjudged check would leave the rest of the range
    undecided: its probe is decided by the other gates and names it; a flaky check still leaves
    the probe undecided."""
    from harness.judge.gates import Gate
    from harness.run.bisect import decide

    base = [_doc([("loss_parity", "ddp2", "pass"), ("param_parity", "ddp2", "pass")]) for _ in range(2)]
    unjudged = check_gates(base, [_doc([("loss_parity", "ddp2", "pass"), ("param_parity", "ddp2", "n/a")])] * 2)
    loss = Gate("s", "ddp2", "loss", True, "2.31", "2.31", "within the baseline's spread")
    assert decide(_judged(*unjudged, loss), ("checks",))[0] == UNDECIDED  # the loss was not asked: nothing decides
    outcome, metric, why = decide(_judged(*unjudged, loss), ("checks", "loss"))
    assert (outcome, metric) == (GOOD, "every gate") and "not judged at this commit, s/ddp2: param_parity" in why
    flaky = check_gates(base, [_doc([("loss_parity", "ddp2", r), ("param_parity", "ddp2", "n/a")])
                               for r in ("FAIL", "pass")])
    assert decide(_judged(*flaky), ("checks",))[0] == UNDECIDED


def _judged(*gates) -> object:  # noqa: ANN002
    from harness.run.pairs import PairedJudgement

    return PairedJudgement(list(gates), [], [], {})


def test_a_run_that_fails_makes_a_probe_bad_whatever_the_metrics_and_no_gate_is_undecided() -> None:
    from harness.judge.gates import Gate, PairedGate
    from harness.run.bisect import decide

    crashed = Gate("s", "ddp2", "run", False, "1 failed repeat(s)", "passed", "every repeat passes")
    fast = PairedGate("s", "single", "throughput (paired)", True, "1000", "1000", "at most 0% slower", "level")
    assert decide(_judged(crashed, fast), ("speed",))[:2] == (BAD, "run s/ddp2")
    assert decide(_judged(fast), ("speed",))[0] == GOOD
    outcome, metric, why = decide(_judged(fast), ("checks",))  # nothing of what was asked could be judged
    assert (outcome, metric) == (UNDECIDED, "no gate") and "checks" in why
    slow = PairedGate("s", "single", "throughput (paired)", False, "800", "1000", "at most 0% slower", "",
                      inconclusive=True)
    assert decide(_judged(slow), ("speed",))[0] == UNDECIDED
