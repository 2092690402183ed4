"""``collective_agreement``: every run of more than one rank, its ranks' collective ledgers
compared call by call (``harness.controller.ledgers``, read from ``RunOutcome.collectives``):
the same op, shape, dtype and group at every sequence number, or the first call at which they
differ, named with each side's call site, step and ranks. A run whose ranks kept no ledger is
"n/a", saying why, never a pass. A failed check of a run whose collectives diverged points to the
divergence first: what the ranks computed apart follows from it."""

from __future__ import annotations

from harness.controller.outcome import RunOutcome
from harness.judge.checks import Check
from harness.scenario.checks import CheckName

NO_LEDGER = "MLX_DDP_HARNESS_LEDGER=0, or an executable that keeps none"


def collective_agreement(run: RunOutcome) -> Check:
    name, c = CheckName.collective_agreement, run.collectives
    if c is None or c.get("agree") is None or c.get("missing"):
        missing = (c or {}).get("missing") or list(range(run.world_size))
        said = "no rank kept a collective ledger" if len(missing) == run.world_size else \
            ("rank " if len(missing) == 1 else "ranks ") + ", ".join(map(str, missing)) + " kept no collective ledger"
        return Check(name, run.name, True, None, None, f"not applicable: {said} ({NO_LEDGER})", applicable=False)
    derivation = "exact: every rank's call at each sequence number has the same op, shape, dtype and group"
    if not c["agree"]:
        return Check(name, run.name, False, 1, 0, c["line"], derivation=derivation)
    return Check(name, run.name, True, 0, 0, c["line"], derivation=derivation)


def point_to_divergence(run: RunOutcome, checks: list[Check]) -> None:
    """Each other failed check of ``run`` (whose ``checks`` these are) says first that its
    ``collective_agreement`` failed, and at which call."""
    diverged = next((c for c in checks if c.name == CheckName.collective_agreement and not c.passed
                     and c.applicable and c.xfail is None), None)
    if diverged is None or run.collectives is None:
        return
    for c in checks:
        if c is not diverged and not c.passed and c.applicable and not c.caught:
            c.detail = (f"the ranks' collectives diverged first, at call #{run.collectives['seq']} "
                        f"(collective_agreement); {c.detail}")
