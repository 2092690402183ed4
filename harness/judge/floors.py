"""What each comparison's trajectories are judged against: its floor run (``harness.scenario.runs``; a split
floor's draws of the rounding, all of them), unless that run is refused as a floor, or the
absolute tolerance the scenario set."""

from __future__ import annotations

from harness.controller.outcome import RunOutcome
from harness.judge.parity import Floor, step_local
from harness.scenario.plan import ScenarioPlan

TOLERANCE_KEYS = {"loss": "loss_tolerance", "param": "param_tolerance", "eval": "eval_tolerance"}


def floors(plan: ScenarioPlan, run: str, base: str, by_name: dict[str, RunOutcome],
           resume: bool = False) -> dict[str, Floor]:
    """What each of a comparison's trajectories (loss, param, eval) of ``run`` with ``base`` is
    judged against: its planned floor run, or the absolute tolerance the scenario set
    (``resume``: ``resume_tolerance`` for all)."""
    planned = plan.run(run).floor_for(base)
    measured = by_name.get(planned.name) if planned else None
    samples = tuple(by_name.get(f.name) for f in planned.samples()[1:]) if planned else ()
    rerun = planned is not None and planned.kind == "rerun"
    twin = planned is not None and planned.kind == "twin"
    refused = floor_refused(plan, measured, by_name.get(base)) if twin else None
    steps = (other_steps(m, by_name.get(base)) for m in (measured, *samples))
    refused = refused or next(filter(None, steps), None)
    keys = dict.fromkeys(TOLERANCE_KEYS, "resume_tolerance") if resume else TOLERANCE_KEYS
    return {metric: Floor(measured, getattr(plan.scenario.checks, key), key, rerun, refused, samples)
            for metric, key in keys.items()}


def other_steps(floor: RunOutcome | None, base: RunOutcome | None) -> str | None:
    """Why a floor run that trained other steps than its base is no floor for it."""
    if floor is None or base is None or not floor.ok or not base.ok:
        return None
    got, want = floor.result().get("steps"), base.result().get("steps")
    if got == want:
        return None
    return f"floor refused: {floor.name} trained to step {got}, {base.name} to step {want}"


def floor_refused(plan: ScenarioPlan, twin: RunOutcome | None, base: RunOutcome | None) -> str | None:
    """Why a twin is not a noise floor: its step-local parity with the reference failed at the
    rounding limit, so it does not compute the reference's mathematics (a model whose result
    depends on how a batch is split). A split floor run is not held to it: it rounds its logits'
    gradient once more by design. Floors of other runs than the reference are not probed."""
    if twin is None or base is None or not twin.ok or not base.ok or not twin.result().get("probes"):
        return None
    bad = [c for c in step_local(twin, base, plan) if not c.passed and c.value is not None]
    if not bad:
        return None
    c = bad[0]
    return (f"floor refused: {twin.name} is not {base.name}'s mathematics ({c.name} {c.value:.3g} > {c.limit:.3g} "
            f"at the same parameters: the result depends on how the batch is split)")
