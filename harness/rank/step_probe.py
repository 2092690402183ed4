"""Step-local parity probes: the reference's gradient and another run's, at the same parameters.

At each probe step (step 1 and every ``[checks] probe_every`` steps) the reference run records
the parameters its step's gradient is taken at, and that global gradient: rank 0 writes
``probe-step-NNNNNNNN.safetensors`` (``param.<name>`` and ``grad.<name>`` tensors; the global
loss, the token count and the schema version in its metadata). A compared run, at the same step
and on the same global batch, puts the reference's parameters into its model, computes the
global gradient as its training step does (the reference trainer: its own step, only the
update skipped; a trainer under test: through its own loss and reduction, ``Probes.take``, run
eagerly where the trainer compiles its step), measures how far its loss, token count and
gradient are from the reference's, and puts its own parameters back. Its trajectory is
untouched: parameters, optimizer state, data position, MLX's global RNG key and the semantics'
state are what they were before the probe, and the probe's time is not counted in the step's.

Optimizer amplification cannot enter these figures, so the judge holds them to a limit derived
from floating-point rounding alone. A model that computes in a narrower dtype (bfloat16, float16;
frozen weights included) is probed in float32 (``in_float32``): its parameters, exact in float32,
are cast up for the probe and put back after it, so a defect in the reduction is seen at float32's
rounding rather than hidden under bfloat16's; each record says the dtype it computed in.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from harness import schema
from harness.rank.collective_mutations import measuring
from harness.rank.defects import hypotheses, measure, squared_gaps
from harness.scenario.job import ProbeJob
from harness.schema import probe_path


def computed_in(*trees: Any) -> str:
    """The dtype a probe computed in: the coarsest of its loss's and gradient's (a trainer that
    casts down inside its step, or reduces in bfloat16, computed in that)."""
    from harness.rank.precision import coarsest_dtype

    return coarsest_dtype(*trees) or "float32"


@contextmanager
def in_float32(model: Any) -> Iterator[None]:
    """Within it, ``model``'s floating parameters narrower than float32 are float32 (their values
    exact). The parameters are put back on leaving."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    saved = model.parameters()
    if not any(v.dtype in (mx.bfloat16, mx.float16) for _, v in tree_flatten(saved)):
        yield
        return
    model.set_dtype(mx.float32)
    try:
        yield
    finally:
        model.update(saved)


class Probes:
    """The job's probe plan (``harness.scenario.job.ProbeJob``) and what it measured."""

    def __init__(self, spec: ProbeJob | None):
        self.mode = spec.mode if spec else None
        self.dir = Path(spec.dir) if spec else None
        self.steps = set(spec.steps) if spec else set()
        self.records: list[dict[str, Any]] = []

    def run(self, t: Any, step: int, micros: list[Any], counts: tuple[int, int]) -> float:
        """Probe ``step`` on trainer ``t``; returns the seconds it took."""
        start = time.perf_counter()
        if self.mode == "record":
            with in_float32(t.model):
                loss, grads, _ = t.global_gradient(step, micros, counts, None, update=False)
            dtype = computed_in(loss, grads)
            t.coord.attempt("probe", step, t.effects.probe, probe_path(self.dir, step), t.model, grads,
                            {"step": step, "loss": float(loss.item()), "tokens": counts[0], "world_size": t.N})
            self.records.append({"step": step, "loss": float(loss.item()), "tokens": counts[0], "dtype": dtype})
        else:
            self.records.append(self._compare(t, step, micros, counts))
        self.records[-1]["probe_s"] = time.perf_counter() - start
        return self.records[-1]["probe_s"]

    def take(self, step: int, model: Any, compute: Callable[[], tuple[Any, Any, int]], rank: int,
             world_size: int, micros: Callable[[], list[tuple[Any, Any, Any]] | None] | None = None) -> float:
        """A trainer under test probes ``step`` through its own seam: ``compute()`` returns its global
        loss, all-reduced gradient and global supervised tokens at ``model``'s current parameters on
        the step's batch, through the trainer's own loss and reduction, without updating anything.
        Recording, rank 0 keeps the parameters and gradient; comparing, ``compute`` runs
        at the reference's parameters and the model gets its own back; where ``micros()`` gives
        this rank's micro-batches as ``(inputs, targets, mask)`` (the same on every rank: it is
        followed by collectives), the known defects are measured there too (``harness.rank.defects``).
        Returns the seconds it took."""
        import mlx.core as mx
        from mlx.utils import tree_unflatten

        start = time.perf_counter()
        key = mx.random.state[0].tolist()  # MLX's global RNG, as the step will find it
        if self.mode == "record":
            try:
                with in_float32(model):
                    loss, grads, tokens = compute()
                    mx.eval(loss, grads)
            finally:
                restore_key(key)
            dtype = computed_in(loss, grads)
            if rank == 0:
                write_probe(probe_path(self.dir, step), model, grads, {"step": step, "loss": float(loss.item()),
                                                                       "tokens": int(tokens), "world_size": world_size})
            self.records.append({"step": step, "loss": float(loss.item()), "tokens": int(tokens), "dtype": dtype})
        else:
            ref = read_probe(probe_path(self.dir, step))
            saved = model.parameters()
            model.update(tree_unflatten(list(ref["params"].items())))
            try:
                with in_float32(model):
                    loss, grads, tokens = compute()
                    mx.eval(loss, grads)
                    dtype = computed_in(loss, grads)
                    rows = micros() if micros is not None and self.mode == "compare" else None
                    with measuring():  # the harness's own collectives: a collective mutation leaves them alone
                        found = hypotheses(model, rows, rank, world_size) if rows else None
            finally:
                model.update(saved)
                restore_key(key)
            self.records.append({**compare(step, loss, grads, int(tokens), ref), "dtype": dtype})
            if found is not None:
                self.records[-1]["defects"] = measure(found, loss, grads, int(tokens), ref)
        self.records[-1]["probe_s"] = time.perf_counter() - start
        return self.records[-1]["probe_s"]

    def _compare(self, t: Any, step: int, micros: list[Any], counts: tuple[int, int]) -> dict[str, Any]:
        """Every rank measures its own reduced gradient against the reference's (a failure on any
        rank stops every rank at the next agreement, as in training)."""
        from mlx.utils import tree_unflatten

        ref = t.coord.attempt("probe", step, read_probe, probe_path(self.dir, step))
        saved, state = t.model.parameters(), t.semantics.state()
        if ref is not None:
            t.model.update(tree_unflatten(list(ref["params"].items())))
        with in_float32(t.model):
            loss, grads, _ = t.global_gradient(step, micros, counts, None, update=False)
            dtype = computed_in(loss, grads)
            found = None
            if self.mode == "compare":  # a floor run's (``ProbeJob``) would be read by no check
                with measuring():
                    found = hypotheses(t.model, [batch_micro(b.arrays()) for b in micros], t.ctx.rank, t.N)
        t.semantics.set_state(state)
        t.model.update(saved)
        record = t.coord.attempt("probe", step, compare, step, loss, grads, counts[0], ref)
        t.coord.agree()
        if record is not None:
            record["dtype"] = dtype
        if record is not None and ref is not None and found is not None:
            record["defects"] = measure(found, loss, grads, counts[0], ref)
        return record


def batch_micro(arrays: dict[str, Any]) -> tuple[Any, ...]:
    """The reference trainer's micro-batch (``LocalBatch.arrays()``) as ``harness.rank.defects``
    takes it: a vision-language batch with the forward that takes its images."""
    if "attention" not in arrays:
        return arrays["inputs"], arrays["targets"], arrays["mask"]
    from harness.rank.vision import vlm_logits

    return arrays["inputs"], arrays["targets"], arrays["mask"], lambda m: vlm_logits(m, arrays)


def restore_key(key: list[int]) -> None:
    """Put MLX's global RNG key back where a probe found it (a key ``[hi, lo]`` is what seeding
    with ``hi << 32 | lo`` makes), so that a probe that draws (dropout) leaves the step's draws alone."""
    import mlx.core as mx

    if mx.random.state[0].tolist() != key:
        mx.random.seed((int(key[0]) << 32) | int(key[1]))


def compare(step: int, loss: Any, grads: Any, tokens: int, ref: dict[str, Any]) -> dict[str, Any]:
    """Loss, token count and gradient at a probe step vs the reference's: the gradient's relative
    error ||g - g_ref|| / ||g_ref|| over all tensors, and the tensor with the largest one."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    mine, theirs = dict(tree_flatten(grads)), ref["grads"]
    if mine.keys() != theirs.keys():
        raise ValueError(f"gradient names differ from the reference's ({sorted(mine.keys() ^ theirs.keys())[:3]})")
    sq = squared_gaps(mine, theirs)
    mx.eval(sq)
    per = {k: (float(d), float(r)) for k, (d, r) in sq.items()}
    diff, norm = sum(d for d, _ in per.values()), sum(r for _, r in per.values())
    rel = {k: math.sqrt(d / r) if r > 0 else (0.0 if d == 0 else math.inf) for k, (d, r) in per.items()}
    worst = max(rel, key=lambda k: rel[k])
    return {"step": step, "loss": float(loss.item()), "loss_ref": ref["loss"], "tokens": tokens,
            "tokens_ref": ref["tokens"], "grad_rel": math.sqrt(diff / norm) if norm > 0 else math.inf,
            "worst_tensor": worst, "worst_rel": rel[worst], "ref_world_size": ref["world_size"]}


def write_probe(path: Path, model: Any, grads: Any, meta: dict[str, Any]) -> None:
    """The reference's parameters and gradient at a probe step (rank 0, atomically; ``host_read``)."""
    from mlx.utils import tree_flatten

    from harness.rank.host_read import write_safetensors

    arrays = {f"param.{k}": v for k, v in tree_flatten(model.parameters())}
    arrays.update({f"grad.{k}": v for k, v in tree_flatten(grads)})
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {k: str(v) for k, v in meta.items()} | {"schema_version": str(schema.SCHEMA_VERSION)}
    write_safetensors(path, arrays, metadata)


def read_probe(path: Path) -> dict[str, Any]:
    """A probe file written by ``write_probe``; a missing file or another schema version raises."""
    import mlx.core as mx

    arrays, meta = mx.load(str(path), return_metadata=True)
    if meta.get("schema_version") != str(schema.SCHEMA_VERSION):
        raise schema.SchemaError(f"{path}: schema_version {meta.get('schema_version')!r}, "
                                 f"expected {schema.SCHEMA_VERSION}")
    return {"params": {k[6:]: v for k, v in arrays.items() if k.startswith("param.")},
            "grads": {k[5:]: v for k, v in arrays.items() if k.startswith("grad.")},
            "loss": float(meta["loss"]), "tokens": int(meta["tokens"]), "world_size": int(meta["world_size"])}
