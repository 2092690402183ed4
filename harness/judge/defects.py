"""Naming the defect behind a failed step-local check: the known DDP defects the ranks measured
as hypotheses at the reference's parameters (``harness.rank.defects``), each tested against the
trainer's own figure (its loss for ``step_loss_parity``, its gradient for ``step_grad_parity``)
within that check's limits.

A hypothesis matches when, at every probe step and on every rank, the figure is within the
step's limit of what it predicts. ``correct`` matching means the reduction is right on the run's
own rows and those rows are not the reference's: ``same_rows`` where that matches too. Where
the trainer gives the harness no micro-batches it can read, the text says which seam would let
it name the defect.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.scenario.checks import CheckName
from harness.scenario.names import DEFECTS_DESCRIBED as DESCRIBED

PREFERRED = ("mean_of_means", "micro_means", "no_allreduce", "no_allreduce_global", "no_allreduce_scaled",
             "not_divided_by_world", "local_token_count", "grad_times_world", "same_rows", "rank_scaled", "correct")
FITTED = ("rank_scaled",)  # fitted to the trainer's own figure: named only where nothing fixed matches
SCALES_APART = 1e-3  # ``rank_scaled`` is a defect only where its fitted factors differ by more than this
N = CheckName
TRAJECTORIES = (N.loss_parity, N.param_parity, N.eval_parity)
FIGURES = {"loss": ("loss_rel", "loss"), "grad": ("grad_rel", "gradient")}
SEAM = "this rank's micro-batches as (inputs, targets, mask) at each probe"


def unnamed_trajectory(checks: list[Any], probe_every: int, not_applicable: dict[str, str]) -> str | None:
    """For a run whose trajectory failed with no step-local failure to name a defect from: which
    step-local seam would let the harness name it (None where a step-local check failed or no
    trajectory did)."""
    failed = {c.name for c in checks if not c.passed and c.name not in not_applicable}  # n/a ones are not judged
    if not failed & set(TRAJECTORIES) or failed & {N.step_loss_parity, N.step_grad_parity, N.start_parity}:
        return None
    if not probe_every:
        return ("no defect named: the scenario probes no step ([checks] probe_every = 0); step-local values at "
                "the reference's parameters would let the harness name it")
    why = not_applicable.get(N.step_grad_parity)
    if why:
        return f"no defect named: it needs step-local values at the reference's parameters, and {why}"
    return ("no defect named: the step-local checks passed, so each probed step's loss and gradient are right: "
            "look at what carries across steps (the optimizer and its state, the schedule, the data order)")


@dataclass(frozen=True)
class Diagnosis:
    """What the judge could say: the defect's key (None: none named) and the sentence."""

    defect: str | None
    text: str


def _worst(recs: list[dict[str, Any]], name: str, field: str,
           limit: Callable[[dict[str, Any]], float]) -> tuple[float, float, float]:
    """The hypothesis's worst (ratio to the limit, value, limit) over the records."""
    figures = []
    for rec in recs:
        value, lim = rec["defects"][name][field], limit(rec)
        figures.append((value / lim if lim > 0 else (0.0 if value == 0 else float("inf")), value, lim))
    return max(figures, key=lambda f: f[0])


def _apart(recs: list[dict[str, Any]]) -> bool:
    """Whether ``rank_scaled``'s fitted factors differ between ranks at some probe."""
    return any(max(f) - min(f) > SCALES_APART * max(abs(x) for x in f)
               for rec in recs if (f := rec["defects"]["rank_scaled"].get("scales")))


def name_defect(per_rank: list[list[dict[str, Any]]], key: str, limit: Callable[[dict[str, Any]], float],
                seam: str = SEAM) -> Diagnosis:
    """The known defect the probe records (``per_rank``: each rank's) match in figure ``key``
    ("loss" or "grad") within ``limit``, or why none is named. ``seam``: what the trainer would
    have to hand over, where it hands none."""
    recs = [rec for recs in per_rank for rec in recs]
    if not recs or any("defects" not in rec for rec in recs):
        return Diagnosis(None, f"no defect named: the harness needs {seam}")
    unusable = next((rec["defects"]["unusable"] for rec in recs if "unusable" in rec["defects"]), None)
    if unusable:
        return Diagnosis(None, f"no defect named: {unusable}")
    field, figure = FIGURES[key]
    fits = {name: _worst(recs, name, field, limit) for name in PREFERRED
            if all(name in rec["defects"] for rec in recs) and (name not in FITTED or key == "grad")}
    matched = [name for name, w in fits.items() if w[0] <= 1]
    if matched == ["rank_scaled"] and _apart(recs):  # all factors 1 fit where "correct" does
        scales = ", ".join(f"{a:.3g}" for a in recs[0]["defects"]["rank_scaled"]["scales"])
        _, value, lim = fits["rank_scaled"]
        return Diagnosis("rank_scaled", f"matches: {DESCRIBED['rank_scaled']}, the ranks' factors {scales}; "
                                        f"{figure} {value:.2g} against a limit of {lim:.2g}")
    matched = [name for name in matched if name not in FITTED]
    if not matched:
        return Diagnosis(None, f"no known defect matches its {figure}")
    if "correct" in matched:  # right on the run's own rows: the rows are what differs
        best = "same_rows" if "same_rows" in matched else "correct"
        off = max(rec["defects"]["correct"]["ref_grad_rel"] for rec in recs)
        _, value, lim = fits[best]
        rows = f"its {figure} {value:.2g} against a limit of {lim:.2g}; on these rows the correct gradient is " \
               f"{off:.3g} from the reference's"
        if best == "same_rows":
            return Diagnosis(best, f"matches: {DESCRIBED[best]}, {rows}")
        return Diagnosis("other_rows", f"matches: {DESCRIBED['correct']} on the run's own rows, which are not the "
                                       f"reference's ({rows}): {DESCRIBED['other_rows']}")
    best = matched[0]
    _, value, lim = fits[best]
    also = [DESCRIBED[n] for n in matched[1:]]
    text = f"matches: {DESCRIBED[best]}, {figure} {value:.2g} against a limit of {lim:.2g}"
    return Diagnosis(best, text + (f"; as well: {'; '.join(also)} (alike on these rows)" if also else ""))
