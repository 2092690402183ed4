"""Checks of resumed runs: parity with the run they must reproduce, accounting, and which
checkpoint every rank resumed from."""

from __future__ import annotations

from harness.controller.cpu_use import speed_disturbed
from harness.controller.outcome import RunOutcome
from harness.judge.checks import Check, fastest_after_first, with_power
from harness.judge.floors import floors
from harness.judge.parity import eval_parity, loss_parity, param_parity, unrecorded
from harness.scenario import RunSpec
from harness.scenario.checks import CheckName
from harness.scenario.plan import ScenarioPlan


def resume_parity(run: RunOutcome, target: RunOutcome, plan: ScenarioPlan,
                  by_name: dict[str, RunOutcome]) -> list[Check]:
    """Per-step losses, final parameters and eval losses vs ``target``. At the same world size and
    compile mode: against a rerun of ``target`` (bitwise when the rerun was bitwise), or the
    scenario's ``resume_tolerance``; across world sizes: the parity criterion (``target``
    reordered, or the parity tolerances)."""
    f = floors(plan, run.name, target.name, by_name, resume=plan.run(run.name).resumes_alike)
    out = [loss_parity(run, target, f["loss"], plan, CheckName.resume_loss_parity),
           param_parity(run, target, f["param"], plan, CheckName.resume_param_parity)]
    if run.result().get("evals") or target.result().get("evals"):
        out.append(eval_parity(run, target, f["eval"], plan, CheckName.resume_eval_parity))
    return out


def resume_accounting(run: RunOutcome, target: RunOutcome, source: RunOutcome | None, factor: float) -> Check:
    """Steps, tokens (global, per step and per rank) equal ``target``'s; the steps before the
    checkpoint keep the throughput the source run measured; the fastest tok/s of the steps it
    trained (after its first) within ``factor`` of ``target``'s over the same steps. A
    run whose trainer restores no record of the steps before its checkpoint is held to
    ``target``'s figures from the step its history starts."""
    r, t = run.result(), target.result()
    skip = unrecorded(run)  # a run without a record of its first steps: the target's from there
    target_steps = (t.get("tokens_global_per_step") or [])[skip:] if skip else t.get("tokens_global_per_step")
    expected = {"steps": t.get("steps"), "tokens_global": sum(target_steps or []) if skip else t.get("tokens_global"),
                "tokens_global_per_step": target_steps}
    problems = [f"{key} differs" for key, value in expected.items() if r.get(key) != value]
    if run.world_size == target.world_size:
        mine = [o.result.get("tokens_local") for o in run.ranks if o.result]
        theirs = [sum((o.result.get("tokens_local_per_step") or [])[skip:]) if skip else o.result.get("tokens_local")
                  for o in target.ranks if o.result]
        if mine != theirs:
            problems.append(f"per-rank tokens {mine} vs {theirs}")
    k = (r.get("resume") or {}).get("step") or 0
    if source is not None and source.ok and k and not skip:
        if r.get("tok_s_global", [])[:k] != source.result().get("tok_s_global", [])[:k]:
            problems.append(f"the restored tok/s of steps 1-{k} differ from {source.name}'s")
    # The steps this run trained (after the first, which builds graphs and allocates), at each
    # run's fastest: another process on the machine only ever makes a step slower, so the
    # fastest step is each run's least disturbed figure, and a resumed run that is really slower
    # (recompiling, or eager where the target compiled) is slower in every step, that one too.
    # Unless another job kept the machine's free cores busy through a whole run, or other
    # launches shared its GPU for most of it: then neither run's fastest step is a clean
    # figure, and the speeds are shown but not judged.
    a = fastest_after_first((r.get("tok_s_global") or [])[k - skip:])
    b = fastest_after_first((t.get("tok_s_global") or [])[k:])
    ratio = a / b if a and b else None
    same_world = run.world_size == target.world_size
    busy = busy_during(run, target)
    if same_world and not busy and (ratio is None or not 1 / factor <= ratio <= factor):
        problems.append(f"fastest tok/s {a} vs {b}")
    detail = (f"vs {target.name}: {r.get('steps')} steps, {r.get('tokens_global')} tokens"
              + (f" in steps {skip + 1}-{r.get('steps')} (no record of the steps before)" if skip else "")
              + f"; fastest tok/s of steps {k + 2}-{r.get('steps')} {a or 0:.0f} vs {b or 0:.0f}"
              + (" (other world size: not compared)" if not same_world else
                 f" (not compared: {busy})" if busy else ""))
    if problems:
        detail += "; " + "; ".join(problems)
    return Check(CheckName.resume_accounting, run.name, not problems, None if ratio is None else round(ratio, 3),
                 factor, detail)


def busy_during(*runs: RunOutcome) -> str | None:
    """Why the speeds of ``runs`` cannot be compared (``speed_disturbed``), if anything."""
    for run in runs:
        accelerator = next((o.result.get("accelerator") for o in run.ranks if o.result), None)
        why = speed_disturbed(run.world_size, run.watch.cpu, run.watch.neighbours, accelerator)
        if why is not None:
            return f"during {run.name} {why}"
    return None


def resume_source(run: RunOutcome, spec: RunSpec) -> Check:
    """Every rank resumed from the same checkpoint, of the expected step."""
    infos = [(o.result or {}).get("resume") or {} for o in run.ranks]
    steps = [i.get("step") for i in infos]
    same = len({i.get("identity") for i in infos}) == 1
    ok = same and all(st == spec.expect_resume_step for st in steps)
    first = infos[0]
    detail = f"{first.get('identity', 'no checkpoint')} of {spec.resume_from}" if first else "did not resume"
    if first.get("restored"):
        detail += f"; restored {first['restored']}"
    if "seed_checkpoint" in first:
        detail += (f"; seed {first.get('seed_scenario')} in the scenario, {first.get('seed_checkpoint')} from the "
                   f"checkpoint (used)")
        if first.get("skipped_partials"):
            detail += f"; unfinished, not used: {', '.join(first['skipped_partials'])}"
        if first.get("world_size_changed"):
            detail += f"; made with {first['made_with']['world_size']} ranks"
    if not same:
        detail += "; ranks resumed from different checkpoints"
    return Check(CheckName.resume_step, run.name, ok, steps[0], spec.expect_resume_step, detail)


def judge_resume(plan: ScenarioPlan, run: RunOutcome, by_name: dict[str, RunOutcome]) -> list[Check]:
    """The resume checks of one run (none when it neither resumes nor names a run to reproduce)."""
    spec = plan.run(run.name).spec
    out = []
    if spec.expect_resume_step is not None:
        out.append(resume_source(run, spec))
    target = by_name.get(spec.compare_to) if spec.compare_to else None
    if spec.compare_to is not None:
        if target is None or not target.ok:
            return [*out, Check(CheckName.resume_loss_parity, run.name, False, None, None,
                                f"{spec.compare_to} did not complete: nothing to compare with")]
        out.extend(with_power(resume_parity(run, target, plan, by_name), run, target))
        source = by_name.get(spec.resume_from) if spec.resume_from else None
        out.append(resume_accounting(run, target, source, plan.scenario.checks.resume_tok_s_factor))
    return out
