"""What a checkpoint holds of the trainer, and whether a run may continue from it.

A resumed run must continue exactly as if it had never stopped. The checkpoint therefore holds,
besides parameters and optimizer state (which carries the optimizer step, and so the
learning-rate schedule's position), the trainer state: the seed every random draw is keyed
from, the data position, token counters, the loss/eval/throughput history, the replica digests
and the compile state. Everything that decides the trajectory (model, data, global batch,
optimizer settings, schedule length) must be what the checkpoint was made with, or the resume
is refused naming the first setting that differs. The world size, gradient accumulation at
the same global batch, eval and checkpoint cadence may change: the data plan and the
token-weighted step do not depend on them.

``write_checkpoint``, ``open_checkpoint`` and ``load_weights`` with ``restore`` are the trainer's
three moments: every rank takes part in each, under failure consensus. They see the trainer's
state as dicts and its ``Progress`` only (``Trainer.state_dict`` / ``load_state_dict``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.scenario import Scenario
from harness.trainers.reference import checkpoint
from harness.trainers.reference.checkpoint import FORMAT, CheckpointError
from harness.trainers.reference.progress import LOCAL_HISTORY, Progress
from harness.trainers.reference.step import restore_in_place

TRAJECTORY_TRAIN = ("steps", "learning_rate", "optimizer", "lr_schedule", "warmup_steps", "min_lr_ratio",
                    "weight_decay", "max_grad_norm", "input_dropout")
TRAJECTORY_DATA = ("source", "path", "format", "response_only", "rows", "min_chars", "max_chars", "max_seq_len",
                   "tokenizer", "order", "streaming", "eval_rows", "eval_path", "image_size")
GLOBAL_HISTORY = ("losses", "grad_norms", "learning_rates", "tok_s_global", "tokens_global_per_step",
                  "images_global_per_step", "img_s_global")
DEFAULTS = {"train.optimizer": "adamw"}
# Every draw is keyed by the seed (no generator carries state between steps), so the seed and
# the step restore them all.
RNG_KEYS = {"train rows": "[seed, 1]", "eval rows": "[seed, 4]", "eval images": "[seed, 6]", "batch plan": "[seed, 2]",
            "epoch order": "[seed, 3, epoch]", "input dropout": "[seed, step, row, 5]", "init": "key(seed)"}


def fingerprint(s: Scenario) -> dict[str, Any]:
    """The settings that decide the training trajectory."""
    return {
        "model": dataclasses.asdict(s.model),
        "global_batch": s.train.global_batch,
        **{f"train.{k}": getattr(s.train, k) for k in TRAJECTORY_TRAIN},
        **{f"data.{k}": getattr(s.data, k) for k in TRAJECTORY_DATA},
    }


def check_fits(state: dict[str, Any], s: Scenario, where: str) -> None:
    """Refuse a checkpoint this run cannot continue exactly; ``where`` names its trainer.json."""
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{where}: format {state.get('format')!r}, expected {FORMAT}")
    then, now = state["fingerprint"], fingerprint(s)
    gb_then, gb_now = then.get("global_batch"), now["global_batch"]
    if gb_then != gb_now:
        raise CheckpointError(
            f"{where}: made with global_batch {gb_then}, this run has {gb_now}; refusing to resume, because "
            f"the remaining steps would see different rows and the per-step update would change "
            f"(resume with global_batch = {gb_then}; the world size and grad_accum may change)")
    for key in sorted(set(then) | set(now)):
        made = then.get(key, DEFAULTS.get(key))  # a setting added since: the checkpoint had its default
        if made != now.get(key):
            raise CheckpointError(f"{where}: made with {key} = {made!r}, this run has {now.get(key)!r}; "
                                  f"refusing to resume a different training run")


def trainer_state(p: Progress, step: int, by_rank: list[list[float]], s: Scenario, world_size: int, train: Any,
                  compile_state: dict[str, Any], train_time_s: float) -> dict[str, Any]:
    """The trainer's state after optimizer step ``step``: its progress ``p`` (``by_rank``: every
    rank's local history), the seed, the data position in ``train`` (this rank's share), what
    the run was made with and its compile state."""
    k = len(p.history["losses"])
    per_rank = [{key: row[i * k:(i + 1) * k] for i, key in enumerate(LOCAL_HISTORY)} for row in by_rank]
    batches = len(train.plan.batches) if hasattr(train, "plan") else None
    t = s.train
    return {
        "format": FORMAT,
        "step": step,
        "seed": s.seed,
        "rng": {"seed": s.seed, "streams": RNG_KEYS},
        "data": {"next_step": step + 1, "rows_consumed": step * t.global_batch, "batches_per_epoch": batches,
                 "epoch": step // batches if batches else None,
                 "batch_in_epoch": step % batches if batches else None,
                 "rows_total": getattr(train, "total_rows", None)},
        "made_with": {"world_size": world_size, "global_batch": t.global_batch, "grad_accum": t.grad_accum,
                      "compile": t.compile},
        "fingerprint": fingerprint(s),
        "tokens": {"global": p.tokens_global, "unattributed": p.tokens_unattributed,
                   "local_by_rank": [int(sum(r["tokens_local_per_step"])) for r in per_rank]},
        "history": {key: p.history[key] for key in GLOBAL_HISTORY},
        "history_by_rank": per_rank,
        "evals": [{key: e[key] for key in ("step", "loss", "ppl", "tokens")} for e in p.evals],
        "digests": {str(s): d for s, d in p.digests.items()},
        "compile": compile_state,
        "train_time_s": train_time_s,
        "segments": [*p.segments, {"steps": [p.start_step, step], "world_size": world_size}],
    }


def restore(p: Progress, state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Put a checkpoint's trainer state into progress ``p`` of ``rank`` of ``world_size``; returns
    what the result reports."""
    made = state["made_with"]
    same_world = made["world_size"] == world_size
    for key in GLOBAL_HISTORY:
        p.history[key] = list(state["history"][key])
    p.tokens_global = state["tokens"]["global"]
    if same_world:
        mine = state["history_by_rank"][rank]
        for key in LOCAL_HISTORY:
            p.history[key] = list(mine[key])
        p.tokens_local = state["tokens"]["local_by_rank"][rank]
        p.tokens_unattributed = state["tokens"]["unattributed"]
    else:  # the earlier ranks' shares do not map onto this run's ranks: no local work, rank 0's step times
        k = len(p.history["losses"])
        p.history["tokens_local_per_step"], p.history["tok_s_local"] = [0] * k, [0.0] * k
        p.history["step_times_s"] = list(state["history_by_rank"][0]["step_times_s"])
        p.tokens_local, p.tokens_unattributed = 0, state["tokens"]["global"]
    p.evals = [dict(e) for e in state["evals"]]
    p.digests = {int(s): d for s, d in state["digests"].items()}
    p.train_time_before = state["train_time_s"]
    p.segments = state["segments"]
    p.start_step = state["step"] + 1
    return {"step": state["step"], "seed_checkpoint": state["seed"], "made_with": made,
            "world_size_changed": not same_world, "local_tokens_restored": same_world}


def write_checkpoint(ctx: Any, coord: Any, effects: Any, root: Path, step: int, keep_last: int,
                     contents: Callable[[], tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]) -> dict | None:
    """Rank 0 writes a checkpoint of step ``step`` under ``root`` (``contents``: the flat
    parameters, optimizer state and trainer state, made when written); every rank agrees that it
    worked. Returns what rank 0 wrote (None on the other ranks)."""

    def write() -> dict[str, Any]:
        damage = []

        def between(name: str) -> None:  # a kill here leaves a partial checkpoint behind
            if name == checkpoint.MODEL and (f := ctx.maybe_fault("checkpoint", step)) is not None:
                damage.append(f)

        params, opt, state = contents()
        info = checkpoint.write(root, step, params, opt, state, keep_last, between)
        for f in damage:  # storage failing after the checkpoint was complete
            checkpoint.damage(Path(info["path"]) / f.file, f.action)
            info["damaged"] = f"{f.file} ({f.action})"
        return info

    def attempt() -> dict[str, Any] | None:
        if not ctx.is_main:
            ctx.maybe_fault("checkpoint", step)
        return effects.checkpoint(write)

    info = coord.attempt("checkpoint", step, attempt)
    coord.agree()
    ctx.events.emit("checkpoint", step=step, rank=ctx.rank, **({"bytes": info["bytes"]} if info else {}))
    return info


def open_checkpoint(ctx: Any, coord: Any, s: Scenario) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any],
                                                                 dict[str, Any]]:
    """Find, agree on and verify the checkpoint the job resumes from, on every rank: its
    parameters, optimizer state, trainer state and where it came from."""
    ctx.phase("resume")
    source, wanted = Path(ctx.job.resume.source), ctx.job.resume.step

    def find() -> checkpoint.Checkpoint:
        ck = checkpoint.resolve(source, wanted)
        if ctx.maybe_fault("resume", ck.step) is not None:  # stale_view
            ck = checkpoint.resolve(source, None, hide_newest=True)
        return ck

    ck = coord.attempt("resume", 0, find)
    coord.agree()
    seen = coord.exchange(ck.identity)
    if len(set(seen)) > 1:
        raise coord.stop_all("ranks resolved different checkpoints (every rank must see the same files): "
                             + "; ".join(f"rank {r}: {text}" for r, text in enumerate(seen)))

    def read() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        checkpoint.verify(ck)
        params, opt, state = checkpoint.read(ck)
        check_fits(state, s, str(ck.path / checkpoint.TRAINER))
        return params, opt, state

    loaded = coord.attempt("resume", ck.step, read)
    coord.agree()  # a rank that could not read it stops every rank here
    params, opt, state = loaded
    source_info = {"from": str(ck.path), "identity": ck.identity, "skipped_partials": ck.skipped_partials,
                   "seed_scenario": s.seed}
    return params, opt, state, source_info


def load_weights(model: Any, optimizer: Any, params: dict[str, Any], opt: dict[str, Any], where: Path) -> None:
    """Load a verified checkpoint's parameters into ``model`` (names and shapes must fit) and its
    optimizer state into ``optimizer`` (in place: compiled steps hold it)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    try:
        model.load_weights(list(params.items()), strict=True)
    except ValueError as e:
        raise CheckpointError(f"{where / checkpoint.MODEL}: does not fit the model ({e})") from e
    have = {k: v.shape for k, v in tree_flatten(optimizer.state)}
    got = {k: v.shape for k, v in opt.items()}
    if have != got:
        diff = sorted(set(have) ^ set(got)) or sorted(k for k in have if have[k] != got[k])
        raise CheckpointError(f"{where / checkpoint.OPTIMIZER}: does not fit the optimizer (at {diff[0]})")
    restore_in_place(optimizer.state, tree_unflatten(list(opt.items())))
    mx.eval(model.parameters(), optimizer.state)
