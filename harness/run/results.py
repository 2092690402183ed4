"""The result document (``result.json``): scenarios, their runs' figures and their checks; the exit
codes it decides; reading saved documents back."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from harness import schema
from harness.controller.outcome import RunOutcome
from harness.exit_codes import EXIT_CHECK_FAILED, EXIT_INCONCLUSIVE, EXIT_INFRA, EXIT_PASS
from harness.judge.checks import Check, median_after_first
from harness.run.mutation_summary import mutation_summary
from harness.scenario import ScenarioError, TrainerSpec
from harness.scenario.plan import PlannedRun, ScenarioPlan
from harness.scenario.trainers import TrainerInfo


def per_rank_batch(global_batch: int, world_size: int) -> str:
    lo, hi = global_batch // world_size, -(-global_batch // world_size)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def rank_summary(o: Any, cluster_host: str | None = None) -> dict[str, Any]:
    """One rank's figures; ``cluster_host``: the hostfile's name of the host it ran on (its own
    hostname stays under ``hostname``)."""
    r = o.result or {}
    keys = ("host", "pid", "device", "device_check", "accelerator", "startup_s", "startup_total_s", "startup_parts_s",
            "libraries_loaded", "preloaded", "runtime_s",
            "tokens_local", "tok_s_local", "step_times_s", "mlx_peak_bytes", "rss_peak_bytes", "precision", "error")
    out = {"rank": o.rank, "exit_code": o.exit_code, "status": r.get("status", "missing"),
           **{k: r[k] for k in keys if k in r}}
    if cluster_host is not None:
        out["hostname"], out["host"] = out.get("host"), cluster_host
    return out


def step_widths(per_rank: list[list[int | None]]) -> list[int]:
    """Per step, the widest micro-batch input width (padding included) of any rank; empty when
    the trainer reports none."""
    steps = [[w for w in ws if w is not None] for ws in zip(*per_rank, strict=False)] if all(per_rank) else []
    return [max(ws) for ws in steps if ws]


def startup_summary(run: RunOutcome) -> dict[str, Any] | None:
    """The slowest rank's time from launch to its first step, by part (``harness.rank.startup``),
    and what its first step took beyond the median of the others (compilation, first kernels)."""
    timed = [o.result for o in run.ranks if o.result and "startup_total_s" in o.result]
    if not timed:
        return None
    r = max(timed, key=lambda r: r["startup_total_s"])
    times = r.get("step_times_s") or []
    extra = times[0] - statistics.median(times[1:]) if len(times) > 1 else None
    return {"rank": r["rank"], "total_s": r["startup_total_s"], "parts_s": r["startup_parts_s"],
            "libraries_loaded": r.get("libraries_loaded", []),
            "first_step_extra_s": None if extra is None else round(extra, 4)}


def fine_tune(trainer: TrainerSpec, info: TrainerInfo) -> dict[str, Any]:
    """How a run fine-tunes: ``fine_tune`` "full" or "lora" (then ``lora``: its rank, scale and
    adapted layers, -1: all), or None for a script or command, whose own code decides."""
    if info.script or info.command:
        return {"fine_tune": None, "lora": None}
    lora = {"rank": trainer.lora_rank, "scale": trainer.lora_scale, "layers": trainer.lora_layers}
    return {"fine_tune": trainer.fine_tune, "lora": lora if trainer.fine_tune == "lora" else None}


def run_summary(run: RunOutcome, planned: PlannedRun, ref: RunOutcome | None) -> dict[str, Any]:
    spec, train = planned.spec, planned.eff.train
    micro = per_rank_batch(train.global_batch // train.grad_accum, run.world_size)
    out: dict[str, Any] = {
        "name": run.name,
        "trainer": planned.eff.trainer.kind,
        **fine_tune(planned.eff.trainer, planned.trainer),
        "world_size": run.world_size,
        "backend": run.backend or "none",
        "backend_reason": run.backend_reason,
        "ring_yield": run.ring_yield,
        "warm_start": run.warm_start,
        "device": run.device,
        "device_reason": run.device_reason,
        "ok": run.ok,
        "failure": run.failure,
        "wall_s": run.watch.wall_s,
        "queued_s": round(run.queued_s, 3),
        "cpu_use": run.watch.cpu.to_json() if run.watch.cpu else None,
        "neighbours": run.watch.neighbours.to_json() if run.watch.neighbours else None,
        "per_rank_batch": micro if train.grad_accum == 1 else f"{micro} x {train.grad_accum} accum",
        "global_batch": train.global_batch,
        "ranks": [rank_summary(o, run.hosts[o.rank] if run.hosts else None) for o in run.ranks],
        "hosts": run.hosts,
        "notes": run.notes,
        "collectives": run.collectives,
        "artifacts": str(run.artifacts) if run.artifacts else None,
        "expect_error": spec.expect_error or (f"{spec.mutation}: a rank killed" if spec.fails_by_design else None),
        "resume_from": spec.resume_from,
        "compare_to": spec.compare_to,
        "mutation": spec.mutation,
        "floor": run.floor,
    }
    if not run.ok:
        return out
    r0 = run.result(0)
    losses = r0["losses"]
    runtime = max(o.result["runtime_s"] for o in run.ranks if o.result)
    out.update(
        losses=losses,
        steps=r0["steps"],
        history_start=r0.get("history_start", 1),
        avg_loss=statistics.fmean(losses),
        final_loss=losses[-1],
        runtime_s=runtime,
        launch_overhead_s=run.watch.wall_s - runtime,
        tokens_global=r0["tokens_global"],
        median_tok_s=median_after_first(r0["tok_s_global"]),
        images_global=r0.get("images_global", 0),
        vision=r0.get("vision"),
        median_img_s=median_after_first(r0.get("img_s_global") or []) if r0.get("images_global") else None,
        mlx_peak_bytes=[rk["mlx_peak_bytes"] for rk in out["ranks"]],
        rss_peak_bytes=[rk["rss_peak_bytes"] for rk in out["ranks"]],
        final_digest=r0["final_digest"],
        param_count=r0["param_count"],
        compile=r0["compile"],
        stop=r0["stop"],
        evals=[{k: e[k] for k in ("step", "loss", "tokens")} for e in r0["evals"]],
        data=[(o.result or {}).get("data") for o in run.ranks],
        side_effects=[(o.result or {}).get("side_effects") for o in run.ranks],
        host_rank_map=r0.get("host_rank_map"),
        grad_norms=r0.get("grad_norms"),
        learning_rates=r0["learning_rates"],
        tokens_global_per_step=r0["tokens_global_per_step"],
        tok_s_global=r0["tok_s_global"],
        steps_start=r0["steps_start"],
        train_time_s_total=r0["train_time_s_total"],
        seed_used=r0["seed_used"],
        resume=r0["resume"],
        checkpoints=[{k: c[k] for k in ("step", "bytes", "write_s", "removed") if k in c}
                     for c in r0.get("checkpoints", [])],
        precision=r0["precision"],
        accelerator=r0.get("accelerator"),
        startup=startup_summary(run),
        input_widths=step_widths([(o.result or {}).get("input_widths") or [] for o in run.ranks]),
        probes=[(o.result or {}).get("probes") or [] for o in run.ranks] if r0.get("probes") else None,
    )
    ref_losses = ref.result(0)["losses"] if ref is not None and ref.ok and ref is not run else []
    if len(ref_losses) >= out["steps"]:  # at the same step (a run stopped early is compared there)
        out["final_loss_delta"] = losses[-1] - ref_losses[out["steps"] - 1]
    return out


def model_label(plan: ScenarioPlan, runs: list[RunOutcome]) -> str:
    """``arch size / seq`` as the seed's tables name a model (size from a run's parameter count);
    a script's or an executable's own model (no ``model_config`` reported) as theirs, not the
    scenario's; the trainer is the planned one of the run whose figures it takes."""
    s = plan.scenario
    first = next((r for r in runs if r.ok), None)
    r0 = first.result(0) if first is not None else {}
    count, frozen = r0.get("param_count"), r0.get("param_count_frozen")
    size = f" {count / 1e6:.2f}M" if count else ""
    if count and frozen:  # a LoRA run: the base beside the adapters it trains
        size = f" {frozen / 1e6:.2f}M base + {count / 1e6:.2f}M adapters"
    info = plan.run(first.name).trainer if first is not None else plan.declared[0].trainer
    if (info.script or info.command) and r0.get("model_config") is None:
        return f"the {info.kind}'s own model{size} / {s.data.max_seq_len}"
    return f"{s.model.arch}{size} / {s.data.max_seq_len}"


def scenario_summary(plan: ScenarioPlan, runs: list[RunOutcome], checks: list[Check]) -> dict[str, Any]:
    s = plan.scenario
    ref = next((r for r in runs if r.name == s.checks.reference), None)
    infra = [r for r in runs if not r.ok and not plan.run(r.name).spec.fails_by_design]
    planted = {r.name for r in plan.declared if r.spec.mutation}  # a planted defect is judged as caught or not
    undecided = any(c.inconclusive and c.run not in planted for c in checks)
    status = "error" if infra else ("failed" if not all(c.passed for c in checks) else
                                    "inconclusive" if undecided else "passed")
    return {
        "name": s.name,
        "path": s.path,
        "description": s.description,
        "kind": s.kind,
        "model": model_label(plan, runs),
        "reference": s.checks.reference,
        "status": status,
        "passed": status == "passed",
        "inconclusive": [f"{c.name} ({c.run})" for c in checks if c.result == "inconclusive"],
        "checks": (judged := [c.to_dict() for c in checks]),
        "runs": [run_summary(r, plan.run(r.name), ref) for r in runs],
        "mutations": mutation_summary([(r.name, r.spec.mutation) for r in plan.declared], judged),
    }


REPEAT_STATS = ("median_tok_s", "median_img_s", "runtime_s", "avg_loss", "final_loss", "final_loss_delta")


def spread(values: list[float]) -> dict[str, Any]:
    """The median, the range and the count of ``values`` (one figure over repeats)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def over_repeats(runs: list[dict[str, Any]], refs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """One run's figures over its repeats (``runs``, one per repeat): for each of ``REPEAT_STATS``
    and for ``speed_vs_reference`` (each repeat's tok/s over the reference run's in the same
    repeat, ``refs``) the median, min, max and count of the repeats that completed."""
    ok = [r for r in runs if r.get("ok")]
    out = {k: spread(vals) for k in REPEAT_STATS if (vals := [r[k] for r in ok if r.get(k) is not None])}
    ratios = [r["median_tok_s"] / x["median_tok_s"] for r, x in zip(runs, refs or [], strict=False)
              if r.get("ok") and x.get("ok") and r.get("median_tok_s") and x.get("median_tok_s")]
    if ratios:
        out["speed_vs_reference"] = spread(ratios)
    return out


def merge_repeats(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One scenario summary from its repeats: the first repeat's runs and checks, each run with
    every repeat's figures (``repeats``) and their median and range (``over_repeats``, which the
    run table shows), the checks a later repeat failed (their run named with the repeat), and the
    worst status of all."""
    from harness.judge.baselines import repeat_figures

    first = reps[0]
    if len(reps) == 1:
        return first
    order = ("passed", "inconclusive", "failed", "error")
    merged = dict(first, repeats=len(reps), checks=list(first["checks"]),
                  status=max((r["status"] for r in reps), key=order.index))
    merged["passed"] = merged["status"] == "passed"
    for k, rep in enumerate(reps[1:], start=2):
        merged["checks"] += [dict(c, run=f"{c['run']} (repeat {k})") for c in rep["checks"] if not c["passed"]]

    def runs_of(name: str) -> list[dict[str, Any]]:
        return [next(x for x in rep["runs"] if x["name"] == name) for rep in reps]

    ref = first.get("reference")
    refs = runs_of(ref) if any(r["name"] == ref for r in first["runs"]) else None
    for run in merged["runs"]:
        mine = runs_of(run["name"])
        run["repeats"] = [repeat_figures(x) for x in mine]
        run["over_repeats"] = over_repeats(mine, refs)
    return merged


def exit_code(scenarios: list[dict[str, Any]]) -> int:
    statuses = {s["status"] for s in scenarios}
    if "error" in statuses:
        return EXIT_INFRA
    if "failed" in statuses:
        return EXIT_CHECK_FAILED
    return EXIT_INCONCLUSIVE if "inconclusive" in statuses else EXIT_PASS


def document(scenarios: list[dict[str, Any]], skipped: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The result document: the scenarios, this machine's environment, and what it could not run
    (``skipped``: ``harness.scenario.availability``)."""
    from harness.controller.environment import environment

    code = exit_code(scenarios)
    return schema.stamp({"passed": code == EXIT_PASS, "exit_code": code, "environment": environment(),
                         "scenarios": scenarios, "skipped": skipped or []})


def write_result(out: Path, doc: dict[str, Any]) -> Path:
    """``out/result.json``, written atomically (the directory made where missing)."""
    out.mkdir(parents=True, exist_ok=True)
    result = out / "result.json"
    schema.write_json_atomic(result, doc)
    return result


SCENARIO_KEYS = {"name": str, "runs": list}  # what every reader of a result needs


def load_results(paths: list[str]) -> list[tuple[Path, dict]]:
    """Saved result documents: each path is a ``result.json`` or a directory holding one."""
    docs = []
    for p in map(Path, paths):
        f = p / "result.json" if p.is_dir() else p
        if not f.is_file():
            raise ScenarioError(f"{f}: not found (give a result.json or the --out directory of a run)")
        try:
            doc = schema.read_json(f)
        except schema.SchemaError as e:
            raise ScenarioError(str(e).splitlines()[0]) from e
        if not isinstance(doc.get("scenarios"), list):
            raise ScenarioError(f"{f}: not a result document (no \"scenarios\" list)")
        if not isinstance(doc.get("environment"), dict):
            raise ScenarioError(f"{f}: not a result document (no \"environment\" table)")
        for i, sc in enumerate(doc["scenarios"]):
            missing = [k for k, t in SCENARIO_KEYS.items() if not isinstance(sc, dict) or not isinstance(sc.get(k), t)]
            if missing:
                raise ScenarioError(f"{f}: scenarios[{i}] is not a scenario result (no {', '.join(missing)})")
        docs.append((f, doc))
    return docs
