"""Known DDP defects as hypotheses at a step-local probe: what each would make the global loss,
gradient and token count be on this step's rows, computed with the harness's own loss.

At a comparing probe (``harness.rank.step_probe``), the model holds the reference run's
parameters. Where the trainer hands over its micro-batches as ``(inputs, targets, mask)``
(token ids, next-token targets, a 0/1 supervised mask; ``canonical``), or as ``(inputs, targets,
mask, forward)`` where the logits need more than the token ids (``forward(model)``: a
vision-language model's logits of the micro-batch, its images included), every rank computes its
own pieces with the reference's loss (the summed cross-entropy of the supervised targets): its
loss sum S_r, token count T_r and gradient sum G_r, and per micro-batch the token means. Summed
over the ranks (one all-sum per dtype, ``sum_over_ranks``), they give each hypothesis (N ranks,
T = sum of T_r, on this rank r):

=====================  ==========================================  ==========
hypothesis             loss / gradient                             tokens
=====================  ==========================================  ==========
correct                sum S / T, sum G / T                        T
mean_of_means          mean over ranks of S_r / T_r, G_r / T_r     T
micro_means            (with several micro-batches) the mean over  T
                       every rank's micro-batches of their means
no_allreduce           S_r / T_r, G_r / T_r (this rank's own)      T
no_allreduce_global    sum S / T, G_r / T                          T
no_allreduce_scaled    sum S / T, N x G_r / T                      T
not_divided_by_world   sum over ranks of S_r / T_r, G_r / T_r      T
local_token_count      sum S / T_r, sum G / T_r                    T
grad_times_world       sum S / T, N x sum G / T                    T
same_rows              S_0 / T_0, G_0 / T_0 (rank 0's rows)        N x T_0
rank_scaled            sum S / T, sum a_r G_r / T, the a_r fitted  T
                       to the trainer's gradient (least squares)
=====================  ==========================================  ==========

``rank_scaled`` is the signature of a gradient each rank scales by a factor of its own before the
all-reduce (each rank clipping its own gradient): the trainer's gradient, projected on the span of
the ranks' G_r / T, is within the limit of it, with factors a_r that differ (``measure`` fits them;
every rank's G_r is all-gathered for it, up to ``GATHER_BYTES``).

A rank's own token count T_r (rank 0's for ``same_rows``, and a micro-batch's) divides as
max(T_r, 1), as trainers guard it (the reference's ``mean_of_means`` mutation does): a rank
without supervised tokens adds 0, not 0/0. Their descriptions:
``harness.scenario.names.DEFECTS_DESCRIBED``. The trainer's own figures are measured against
each (``measure``), and ``correct`` against the reference run's; the judge names the one that
matches (``harness.judge.defects``).
"""

from __future__ import annotations

import math
from typing import Any

BUCKET_BYTES = 256 << 20  # the most one all-sum of a probe carries: its concatenation is a copy
GATHER_BYTES = 256 << 20  # the most the ranks' gradients gathered for ``rank_scaled`` may hold


def canonical(args: tuple[Any, ...]) -> bool:
    """Whether a micro-batch is ``(inputs, targets, mask)``: integer token arrays and a mask, one shape."""
    import mlx.core as mx

    if len(args) != 3 or not all(isinstance(a, mx.array) for a in args):
        return False
    inputs, targets, mask = args
    return (inputs.shape == targets.shape == mask.shape and inputs.ndim == 2
            and mx.issubdtype(inputs.dtype, mx.integer) and mx.issubdtype(targets.dtype, mx.integer))


def _pieces(model: Any, micros: list[tuple[Any, ...]]) -> tuple[Any, Any, Any, Any, Any]:
    """This rank's loss sum, token count and gradient sum over its micro-batches, and the sums
    of its micro-batches' own mean losses and gradients, with the reference's loss."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map

    def loss_sum(m: Any, inputs: Any, targets: Any, mask: Any, forward: Any) -> Any:
        logits = (m(inputs) if forward is None else forward(m)).astype(mx.float32)
        return (nn.losses.cross_entropy(logits, targets, reduction="none") * mask.astype(mx.float32)).sum()

    value_and_grad = nn.value_and_grad(model, loss_sum)
    params = model.trainable_parameters()  # a rank with no micro-batch still all-sums, in the dtypes the others do
    g = tree_map(mx.zeros_like, params)
    mg = tree_map(lambda p: mx.zeros(p.shape, mx.result_type(p.dtype, mx.float32)), params)  # as b / n below
    s, t, ms = mx.array(0.0), mx.array(0.0), mx.array(0.0)
    for micro in micros:
        inputs, targets, mask = micro[:3]
        v, grads = value_and_grad(model, inputs, targets, mask, micro[3] if len(micro) > 3 else None)
        n = mask.astype(mx.float32).sum()
        mean_n = mx.maximum(n, 1.0)  # a micro-batch without supervised tokens: its mean is 0
        s, t, ms = s + v, t + n, ms + v / mean_n
        g = tree_map(lambda a, b: a + b, g, grads)
        mg = tree_map(lambda a, b, d=mean_n: a + b / d, mg, grads)
    return s, t, g, ms, mg


def sum_over_ranks(trees: list[Any], world_size: int, group: Any = None) -> list[Any]:
    """Each tree (an array, or a tree of arrays) summed over the ranks, leaf by leaf, in a few
    all-sums: the leaves of one dtype laid end to end, up to ``BUCKET_BYTES`` a sum. A probe needs
    some hundred sums, and each collective waits on the link in turn (on a 40 ms link that was
    11 s a probe step). Every rank must hand over the same shapes and dtypes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    if world_size <= 1:
        return trees
    leaves = [a for t in trees for _, a in tree_flatten(t)]
    buckets: dict[Any, list[list[int]]] = {}  # dtype -> buckets of leaf indices, in leaf order
    filled: dict[Any, int] = {}  # the bytes of each dtype's last bucket
    for i, a in enumerate(leaves):
        per_dtype = buckets.setdefault(a.dtype, [[]])
        if per_dtype[-1] and filled[a.dtype] + a.nbytes > BUCKET_BYTES:
            per_dtype.append([])
            filled[a.dtype] = 0
        per_dtype[-1].append(i)
        filled[a.dtype] = filled.get(a.dtype, 0) + a.nbytes
    summed: list[Any] = [None] * len(leaves)
    for idx in (b for per_dtype in buckets.values() for b in per_dtype):
        flat = mx.distributed.all_sum(mx.concatenate([leaves[i].reshape(-1) for i in idx]), group=group)
        at = 0
        for i in idx:
            summed[i] = flat[at:at + leaves[i].size].reshape(leaves[i].shape)
            at += leaves[i].size
    it = iter(summed)
    return [tree_map(lambda _: next(it), t) for t in trees]


def hypotheses(model: Any, micros: list[tuple[Any, ...]], rank: int, world_size: int) -> dict[str, tuple]:
    """Each hypothesis's (loss, gradient tree, tokens) on this rank (module docstring);
    ``rank_scaled``'s gradient is the list of every rank's G_r / T, fitted in ``measure``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    def mine_or_zero(x: Any) -> Any:
        return tree_map(lambda a: a if rank == 0 else a * 0, x)

    n = float(world_size)
    s, t, g, ms, mg = _pieces(model, micros)
    own = mx.maximum(t, 1.0)  # a rank's own token count as a divisor: a rank without tokens adds 0, not 0/0
    grad_bytes = sum(a.nbytes for _, a in tree_flatten(g))
    gather = world_size > 1 and grad_bytes * world_size <= GATHER_BYTES  # every rank's G_r, for ``rank_scaled``
    slots = [tree_map(lambda a, k=k: a if k == rank else mx.zeros_like(a), g) for k in range(world_size)] \
        if gather else []
    # every rank issues the same collectives whatever its own micro-batch count (an uneven split), in one
    # all-sum per dtype
    m, big_s, big_t, big_g, mean_s, mean_g, s0, t0, g0, sum_ms, sum_mg, *each = sum_over_ranks(
        [mx.array(float(len(micros))), s, t, g, s / own, tree_map(lambda a: a / own, g),
         mine_or_zero(s), mine_or_zero(t), mine_or_zero(g), ms, mg, *slots], world_size)

    first = mx.maximum(t0, 1.0)  # rank 0's own token count, as a divisor

    def over(x: Any, d: Any) -> Any:
        return tree_map(lambda a: a / d, x)

    out = {
        "correct": (big_s / big_t, over(big_g, big_t), big_t),
        "mean_of_means": (mean_s / n, over(mean_g, n), big_t),
        "no_allreduce": (s / own, over(g, own), big_t),
        "no_allreduce_global": (big_s / big_t, over(g, big_t), big_t),
        "no_allreduce_scaled": (big_s / big_t, tree_map(lambda a: a * n / big_t, g), big_t),
        "not_divided_by_world": (mean_s, mean_g, big_t),
        "local_token_count": (big_s / own, over(big_g, own), big_t),
        "grad_times_world": (big_s / big_t, tree_map(lambda a: a * n / big_t, big_g), big_t),
        "same_rows": (s0 / first, over(g0, first), t0 * n),
    }
    micro = (sum_ms / m, over(sum_mg, m), big_t)
    if m.item() > n:  # with one micro-batch a rank, the same as mean_of_means
        out["micro_means"] = micro
    if each:
        out["rank_scaled"] = (big_s / big_t, [over(x, big_t) for x in each], big_t)
    mx.eval(out)
    return out


def fitted(parts: list[Any], grads: dict[str, Any]) -> tuple[dict[str, Any], list[float]] | None:
    """The combination sum a_r parts[r] nearest ``grads`` (least squares over every tensor, the
    inner products in float64 on the host: float32 sums of a gradient's size would misplace the
    factors by more than the check's limit), and the factors a_r; None where no fit is had (a
    gradient that is not finite)."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    flat = [dict(tree_flatten(p)) for p in parts]
    n = len(parts)
    gram, proj = np.zeros((n, n)), np.zeros(n)
    for k in grads:
        vs = [np.array(f[k].astype(mx.float32), dtype=np.float64).ravel() for f in flat]
        g = np.array(grads[k].astype(mx.float32), dtype=np.float64).ravel()
        gram += np.array([[a @ b for b in vs] for a in vs])
        proj += np.array([a @ g for a in vs])
    if not (np.isfinite(gram).all() and np.isfinite(proj).all()):
        return None  # a gradient that is not finite fits no combination
    try:
        scales = np.linalg.lstsq(gram, proj, rcond=None)[0].tolist()
    except np.linalg.LinAlgError:
        return None
    return {k: sum(scales[i] * flat[i][k] for i in range(n)) for k in grads}, scales


def squared_gaps(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Each tensor's ||mine - theirs||^2 and ||theirs||^2 in float32, unevaluated (``mx.square``:
    MLX's CPU ``** 2`` is a slower ``pow`` that is not exact)."""
    import mlx.core as mx

    return {k: (mx.square(mine[k].astype(mx.float32) - theirs[k].astype(mx.float32)).sum(),
                mx.square(theirs[k].astype(mx.float32)).sum()) for k in mine}


def _rel_sums(mine: dict[str, Any], theirs: dict[str, Any]) -> tuple[Any, Any]:
    """||mine - theirs||^2 and ||theirs||^2 over every tensor (summed in ``theirs``' order), unevaluated."""
    gaps = squared_gaps(mine, theirs)
    return sum(gaps[k][0] for k in theirs), sum(gaps[k][1] for k in theirs)


def _rel(d: float, r: float) -> float:
    return math.sqrt(d / r) if r > 0 else (0.0 if d == 0 else math.inf)


def measure(found: dict[str, tuple], loss: Any, grads: Any, tokens: int, ref: dict[str, Any]) -> dict[str, Any]:
    """How far the trainer's figures (its ``loss``, ``grads``, ``tokens``) are from each hypothesis,
    and how far ``correct`` is from the reference run's (``ref``: its probe file): relative error
    of the loss and of the gradient (over every tensor), and the token count each predicts. Every
    figure is evaluated at once: one evaluation, not one per figure."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    mine = dict(tree_flatten(grads))
    lazy: dict[str, Any] = {"loss": loss}
    scales = None
    for name, (h_loss, h_grads, h_tokens) in found.items():
        if name == "rank_scaled":
            if any(dict(tree_flatten(p)).keys() != mine.keys() for p in h_grads):
                continue
            fit = fitted(h_grads, mine)
            if fit is None:
                continue
            h_grads, scales = fit
        theirs = dict(tree_flatten(h_grads))
        if theirs.keys() != mine.keys():
            return {"unusable": f"the harness's gradient names differ from the trainer's "
                                f"({sorted(theirs.keys() ^ mine.keys())[:3]})"}
        lazy[name] = (h_loss, h_tokens, *_rel_sums(mine, theirs))
    c_loss, c_grads, _ = found["correct"]
    lazy["ref"] = _rel_sums(dict(tree_flatten(c_grads)), ref["grads"])
    mx.eval(lazy)
    loss_f = float(lazy["loss"].item())
    out: dict[str, Any] = {}
    for name in found:
        if name not in lazy:
            continue
        h_loss, h_tokens, d, r = lazy[name]
        hl = float(h_loss.item())
        out[name] = {"loss_rel": abs(loss_f - hl) / abs(hl) if hl else (0.0 if loss_f == hl else math.inf),
                     "grad_rel": _rel(float(d.item()), float(r.item())), "tokens": int(round(float(h_tokens.item())))}
    if scales is not None and "rank_scaled" in out:
        out["rank_scaled"]["scales"] = scales
    out["correct"]["ref_grad_rel"] = _rel(*(float(x.item()) for x in lazy["ref"]))
    out["correct"]["ref_loss_rel"] = abs(float(c_loss.item()) - ref["loss"]) / abs(ref["loss"]) if ref["loss"] else 0.0
    return out
