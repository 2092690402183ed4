"""The reference trainer's rank result: what its loop measured, in the result schema every
trainer's result is read by (``harness.schema.train_result``)."""

from __future__ import annotations

import json
from typing import Any

from harness import schema
from harness.rank.models import param_count
from harness.rank.precision import dtype_changes
from harness.trainers.reference import TRAINER


def rank_result(t: Any, last: int, runtime: float, data_rss: int, rng: dict[str, Any]) -> dict[str, Any]:
    """The rank's result record of trainer ``t`` (``harness.trainers.reference.trainer.Trainer``):
    its figures, and every rank's own, exchanged."""
    import mlx.core as mx

    ctx, train = t.ctx, t.data.train
    own = {"rank": ctx.rank, "host": ctx.host, "runtime_s": round(runtime, 4), "tokens": t.progress.tokens_local,
           "mlx_peak_bytes": int(mx.get_peak_memory()), "rss_peak_bytes": t.rss_peak,
           "data_bytes": train.nbytes}
    per_rank = [json.loads(r) for r in t.coord.exchange(json.dumps(own, separators=(",", ":")))]
    hosts: dict[str, list[int]] = {}
    for r in per_rank:
        hosts.setdefault(r["host"], []).append(r["rank"])
    return schema.train_result(**{
        "trainer": {"kind": TRAINER.kind, "title": TRAINER.title},
        **rng,
        "steps": last,
        "steps_planned": t.spec.steps,
        **t.progress.result_fields(last, runtime, t.N),
        "vision": t.data.vision_summary(),
        "runtime_s": runtime,
        "input_widths": t.input_widths,
        "stop_after": t.end_step if t.end_step < t.spec.steps else None,
        "resume": t.resumed,
        "seed_used": t.s.seed,
        "checkpoints": t.checkpoints,
        "rss_step_peak_bytes": t.rss_peak,
        "param_count": param_count(t.model),
        "dtype_changes": dtype_changes(t.start_dtypes, t.model.parameters()),
        "model_config": t.config,
        "stop": t.stop,
        "compile": {"mode": t.spec.compile, "scope": t.runner.scope,
                    "fallback_reason": t.runner.fallback_reason},
        "side_effects": t.effects.counts,
        "data": t.data.summary(data_rss),
        "rows_per_rank_step": sum(len(p) for p in train.positions),
        "per_rank": per_rank,
        "host_rank_map": hosts,
        "collectives": t.coord.collectives,
        "mutation": t.semantics.name if t.semantics.name != "correct" else None,
        "emulate": t.emulate if t.emulate > 1 else None,
        "precision": t.precision,
        "probes": t.probes.records,
    })
