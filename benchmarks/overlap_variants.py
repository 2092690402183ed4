"""The changes tried in the reference trainer's eager step, for ``reference_overlap.py``: each a
subclass of the reference's ``Trainer`` (or ``Semantics``), its values the reference's own
(``reference_overlap.py --check``). ``install`` swaps a proposal's methods into the harness's
``Trainer`` class, in a rank launched by the harness (``--harness``), since such a rank builds the
trainer itself."""

from __future__ import annotations

from typing import Any


def proposed_class() -> type:
    """``Trainer`` with both changes tried in ``global_gradient``: ``start`` (``fwd``: the
    reference's ``start_forward``, which it now calls itself) and ``schedule`` (``sched``)."""
    from harness.trainers.reference.step import start_forward
    from harness.trainers.reference.trainer import Trainer

    base_step = Trainer.global_gradient  # the reference's own (captured before ``install`` replaces it)

    class Proposed(Trainer):
        def global_gradient(self, step: int, micros: list[Any], tokens: tuple[int, int], fault: str | None,
                            update: bool = True) -> tuple[Any, Any, Any]:
            from harness.trainers.reference import trainer as module

            saved, module.start_forward = module.start_forward, self.start  # the step's own forward start
            try:
                loss, grads, norm = base_step(self, step, micros, tokens, fault, update)
            finally:
                module.start_forward = saved
            if update and grads is not None and self.ctx.world_size > 1:
                self.schedule(grads)
            return loss, grads, norm

        start = staticmethod(start_forward)  # the reference's (``fwd``); ``SchedOnly`` has none

        @staticmethod
        def schedule(grads: Any) -> None:
            """On a GPU, hand the reduced gradients to MLX last parameter first: each bucket's
            all-sum is issued as soon as the backward has its gradients, and runs while the backward
            goes on to the layers before it. The arrays are the reduce's own: the values are not
            touched, only the order the GPU computes them in."""
            import mlx.core as mx
            from mlx.utils import tree_flatten

            if mx.default_device() == mx.gpu:
                mx.async_eval([g for _, g in tree_flatten(grads)][::-1])

    return Proposed


def proposals() -> dict[str, type]:
    """``fwd`` (the change proposed), ``sched``, and both together (``new``)."""
    Proposed = proposed_class()

    class SchedOnly(Proposed):
        start = staticmethod(lambda loss_sum: None)

    class FwdOnly(Proposed):
        schedule = staticmethod(lambda grads: None)

    class NoForward(FwdOnly):  # the reference's step before it started its forward
        start = staticmethod(lambda loss_sum: None)

    return {"new": Proposed, "sched": SchedOnly, "fwd": FwdOnly, "nofwd": NoForward}


def install(name: str = "new") -> None:
    """Make the harness's reference trainer proposal ``name`` (for ``--harness``: in each rank)."""
    import inspect

    from harness.trainers.reference import trainer

    cls = proposals()[name]
    for attr in ("global_gradient", "start", "schedule"):
        setattr(trainer.Trainer, attr, inspect.getattr_static(cls, attr))


def variant_classes() -> dict[str, tuple[type, type | None]]:
    """variant -> (trainer class, semantics class or None for the correct one)."""
    import mlx.core as mx

    from harness.trainers.reference.semantics import Semantics
    from harness.trainers.reference.trainer import Trainer

    proposed = proposals()

    class NoStepAgree(Trainer):
        def local_step(self, step: int, micros: list[Any], scale: Any, fault: str | None, update: bool = True
                       ) -> tuple[Any, Any, Any]:
            out = self.coord.attempt("step", step, self._compute_or_compile_error, step, micros, scale, fault, update)
            self.runner.settled()
            return out if out is not None else (None, None, None)

    class LocalLoss(Semantics):
        def loss(self, loss_sum: Any, tokens: int, tokens_local: int) -> Any:
            return loss_sum / tokens

    class Rev64(Semantics):
        def reduce(self, grads: Any) -> Any:
            if self.world_size == 1:
                return grads
            out, reduced = buckets_reduced(grads, self.world_size, True, 64, self.group)
            if mx.default_device() == mx.gpu:
                mx.async_eval(reduced)
            return out

    return {"ref": (Trainer, None), "ref-agree": (NoStepAgree, None), "ref-loss": (Trainer, LocalLoss),
            "ref-ledger": (Trainer, None), "ref-sampler": (Trainer, None), "ref-arrays": (Trainer, None),
            "ref-noagree": (NoStepAgree, None), "sched64": (Trainer, Rev64),
            "sched": (proposed["sched"], None), "fwd": (proposed["fwd"], None), "new": (proposed["new"], None),
            "nofwd": (proposed["nofwd"], None)}


def buckets_reduced(grads: Any, n: int, reverse: bool, mib: int, group: Any = None) -> tuple[Any, list[Any]]:
    """The gradients averaged over ``n`` ranks in buckets of ``mib`` MiB (``allreduce_overlap.py``'s)."""
    from allreduce_overlap import buckets_reduced as reduced_in_buckets

    return reduced_in_buckets(grads, n, reverse, None, mib, group)
