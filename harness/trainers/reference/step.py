"""The local step: loss and gradients of one micro-batch, compiled or eager, and the update.

Compile scopes (recorded in the result):
  none            compile is off;
  full-step       the step's last micro-batch gradient, the gradient all-reduce, clipping and the
                  update in one compiled call (earlier micro-batches of an accumulating step:
                  compiled gradients), as mlx-lm compiles its step;
  local-grad      the micro-batch's loss/gradient function and the update are compiled, the
                  all-reduce between them stays eager (semantics that keep state between steps,
                  and one process emulating N ranks);
  fallback-eager  compiling failed on some rank and every rank went back to eager.

The fused call is lazy: the trainer agrees with its peers that every rank built its step before
it evaluates it, so an error raised while building (a model error, a failed trace) never leaves a
peer waiting in the all-reduce. A compiled call that raises is re-run eagerly on the same inputs:
if eager works too, the failure was the compiler's (``CompileFailed``); if eager fails, the
model's own error is raised as itself. A failed trace leaves tracers in the model, so its arrays
are restored first.
"""

from __future__ import annotations

from typing import Any

from harness.scenario import TrainSpec


class CompileFailed(RuntimeError):
    """``mx.compile`` could not compile a step that runs eagerly; the compiler's error is the cause."""


def restore_in_place(dst: Any, src: Any) -> None:
    """Put ``src``'s arrays back into ``dst``'s containers in place (compile holds references)."""
    items = src.items() if isinstance(src, dict) else enumerate(src)
    for k, v in items:
        if isinstance(v, dict | list):
            restore_in_place(dst[k], v)
        else:
            dst[k] = v


def state_slots(tree: Any, out: list[tuple[Any, Any, Any]] | None = None) -> list[tuple[Any, Any, Any]]:
    """Every leaf of ``tree`` (nested dicts and lists: a model's or an optimizer's state) with the
    container and key that hold it, in one walk: a snapshot that ``put_back`` restores in place.
    A fused step takes one each step, so it is a plain walk (``tree_map`` built new containers
    and took about 7 times as long: 2-5 ms of host time per step on a 28-layer model)."""
    out = [] if out is None else out
    for k, v in tree.items() if isinstance(tree, dict) else enumerate(tree):
        if isinstance(v, dict | list):
            state_slots(v, out)
        else:
            out.append((tree, k, v))
    return out


def call_signature(batch: dict[str, Any], scale: Any, fault: str | None, acc: Any) -> tuple:
    """What decides whether a fused call traces (``mx.compile`` keys its cache on the inputs'
    shapes and dtypes and on its constants, and on the captured state and the device, which stay
    as they are from the first step on): a call whose signature was built before reuses that
    trace, so it cannot leave tracers behind."""
    return (tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(batch.items())),
            tuple(scale.shape), str(scale.dtype), fault, acc is None)


def put_back(slots: list[tuple[Any, Any, Any]]) -> None:
    """Put every leaf of a ``state_slots`` snapshot back where it was taken from."""
    for container, key, value in slots:
        container[key] = value


def loss_fn(model: Any, batch: dict[str, Any], scale: Any, fault: str | None) -> tuple[Any, Any]:
    """(token-loss sum x scale, token-loss sum) of a micro-batch (``LocalBatch.arrays()``: a VLM
    batch has an ``attention`` mask and vision inputs); ``fault`` is for injected errors."""
    import mlx.core as mx
    import mlx.nn as nn

    if "attention" in batch:
        from harness.rank.vision import vlm_logits

        logits = vlm_logits(model, batch).astype(mx.float32)
    else:
        logits = model(batch["inputs"]).astype(mx.float32)
    loss_sum = (nn.losses.cross_entropy(logits, batch["targets"], reduction="none") * batch["mask"]).sum()
    if fault == "raise":
        raise RuntimeError("injected error in the model's forward")
    if fault == "compile_error":
        loss_sum.item()  # what an uncompilable model does: evaluate an array inside the function
    return loss_sum * scale, loss_sum


def grad_norm(leaves: list[Any]) -> Any:
    """The global L2 norm of gradient arrays, summed in float32."""
    import mlx.core as mx

    return mx.sqrt(sum(mx.square(g.astype(mx.float32)).sum() for g in leaves))


def norm_function() -> Any:
    """``grad_norm`` as the trainer runs it: compiled on a GPU, where an eager norm launches four
    kernels per parameter array (about 1,250 for a 28-layer model: 4% of an eager H200 step);
    compiled, the cast and square fuse and the sums fuse into one kernel. It is a diagnostic: no
    update reads it (clipping uses MLX's own ``clip_grad_norm``), so an eager step stays eager."""
    import mlx.core as mx

    return mx.compile(grad_norm) if mx.default_device() == mx.gpu else grad_norm


def start_forward(loss_sum: Any) -> None:
    """On a CUDA GPU, start evaluating an eager step's local forward (its token-loss sum) once
    every rank agreed that it built its step: the GPU computes the forward while the host builds
    the all-reduce and the update (MLX's CUDA backend computes nothing of a lazy graph before it
    is evaluated, and the host builds an eager step for 20-35 ms). The forward holds no
    collective, so no peer can be left waiting in one, and no value changes: it is the same graph,
    evaluated sooner. Not on Metal, where it is unmeasured, nor on the CPU."""
    import mlx.core as mx

    if mx.default_device() == mx.gpu and mx.cuda.is_available():
        mx.async_eval(loss_sum)


class LocalStep:
    """Runs micro-batches through the model in the scenario's compile mode."""

    def __init__(self, model: Any, optimizer: Any, spec: TrainSpec, semantics: Any, alone: bool = False):
        import mlx.core as mx
        import mlx.nn as nn

        self.model, self.optimizer, self.spec, self.semantics = model, optimizer, spec, semantics
        self.mode = spec.compile
        self.fallback_reason: str | None = None
        self.fused = self.mode != "off" and semantics.fusable
        self._vg = nn.value_and_grad(model, loss_fn)
        optimizer.init(model.trainable_parameters())
        self._grad_c = mx.compile(self._grad, inputs=[model.state], outputs=[model.state])
        state = [model.state, optimizer.state]
        self._full_c = mx.compile(self._full, inputs=state, outputs=state)
        self._full_acc_c = mx.compile(self._full_acc, inputs=state, outputs=state)
        self._update_c = mx.compile(self.update, inputs=state, outputs=state)
        self._before: list[tuple[Any, Any, Any]] | None = None
        # A rank without peers (``alone``) restores its state only after its own failed trace:
        # a fused call whose signature was built before needs no snapshot (``full``).
        self.alone = alone
        self._built: set[tuple] = set()
        self._norm = norm_function()

    @property
    def scope(self) -> str:
        if self.fallback_reason is not None:
            return "fallback-eager"
        if self.mode == "off":
            return "none"
        return "full-step" if self.fused else "local-grad"

    @property
    def compiled(self) -> bool:
        return self.mode != "off" and self.fallback_reason is None

    @property
    def fuses(self) -> bool:
        """Whether the next step runs as one fused compiled call."""
        return self.compiled and self.fused

    def fall_back(self, reason: str) -> None:
        self.fallback_reason = reason

    def _grad(self, batch: dict[str, Any], scale: Any, fault: str | None) -> Any:
        (_, loss_sum), grads = self._vg(self.model, batch, scale, fault)
        return loss_sum, grads

    def _full(self, batch: dict[str, Any], scale: Any, fault: str | None) -> Any:
        loss_sum, grads = self._grad(batch, scale, fault)
        return loss_sum, self._reduce_update(grads)

    def _full_acc(self, batch: dict[str, Any], scale: Any, fault: str | None, acc: Any) -> Any:
        from mlx.utils import tree_map

        loss_sum, grads = self._grad(batch, scale, fault)
        return loss_sum, self._reduce_update(tree_map(lambda a, g: a + g, acc, grads))

    def _reduce_update(self, grads: Any) -> Any:
        sem = self.semantics
        return self.update(sem.reduce_shards([sem.accumulated(grads)]))

    def discard(self) -> None:
        """Drop the lazy update of the last fused call: the model and optimizer state from before it
        (a failed trace can leave tracers in any array a model holds: parameters and cached
        buffers such as RoPE frequencies)."""
        if self._before is not None:
            put_back(self._before)
            self._before = None

    def settled(self) -> None:
        """Every rank built its step: the state from before the fused call is no longer needed
        (kept, it would hold a second copy of the parameters and moments until the next step)."""
        self._before = None

    def _classify(self, error: Exception, args: tuple) -> CompileFailed:
        """After a compiled call raised: the model's own error (raised here) or the compiler's."""
        import mlx.core as mx

        eager = self._grad(*args)  # the model's own error propagates from here
        mx.eval(eager)
        return CompileFailed(str(error))

    def grad(self, batch: dict[str, Any], scale: Any, fault: str | None, lazy: bool = False) -> tuple[Any, Any]:
        """(token-loss sum, gradients of sum x scale) of one micro-batch; evaluated unless ``lazy``
        (eager only: a compiled call is evaluated where its failure can be classified)."""
        import mlx.core as mx

        args = (batch, scale, fault)
        if self.compiled:
            state = state_slots(self.model.state)
            try:
                out = self._grad_c(*args)
                mx.eval(out)
                return out
            except Exception as compile_error:  # noqa: BLE001 - classified just below
                put_back(state)
                raise self._classify(compile_error, args) from compile_error
        out = self._grad(*args)
        if not lazy:
            mx.eval(out)
        return out

    def full(self, batch: dict[str, Any], scale: Any, fault: str | None, acc: Any = None) -> tuple[Any, Any]:
        """The fused step (``full-step`` scope), lazy: (token-loss sum, gradient norm); the model
        and optimizer hold the update until evaluated, or until ``discard``. The state from
        before it is kept for ``discard`` (a peer's failure, or this call's failed trace), except
        on a rank without peers whose call reuses a trace: nothing can then ask for it."""
        signature = call_signature(batch, scale, fault, acc)
        reused = self.alone and signature in self._built
        self._before = None if reused else state_slots([self.model.state, self.optimizer.state])
        try:
            out = self._full_c(batch, scale, fault) if acc is None else self._full_acc_c(batch, scale, fault, acc)
        except Exception as compile_error:  # noqa: BLE001 - classified just below
            if reused:  # no state to put back: not re-run eagerly on it, this rank fails
                raise
            self.discard()
            raise self._classify(compile_error, (batch, scale, fault)) from compile_error
        self._built.add(signature)
        return out

    def update(self, grads: Any) -> Any:
        """Clip the (already all-reduced) gradients and apply them (lazily); returns the gradient
        norm (NaN where it is not recorded)."""
        import mlx.core as mx
        import mlx.optimizers as optim
        from mlx.utils import tree_flatten

        if self.spec.max_grad_norm > 0:
            grads, norm = optim.clip_grad_norm(grads, self.spec.max_grad_norm)
        elif self.spec.grad_norms != "off":
            norm = self._norm([g for _, g in tree_flatten(grads)])
        else:  # not recorded (``TrainSpec.grad_norms``): a constant keeps the compiled outputs' shape
            norm = mx.array(float("nan"), dtype=mx.float32)
        self.optimizer.update(self.model, grads)
        return norm

    def apply(self, grads: Any) -> Any:
        """``update``, compiled when the step is (the kernels a fused step's update runs)."""
        return self._update_c(grads) if self.compiled else self.update(grads)
