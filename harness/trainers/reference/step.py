"""The local step: loss and gradients of one micro-batch, compiled or eager, and the update.

Compile scopes (recorded in the result):
  none            compile is off;
  local-grad      under DDP only the micro-batch's loss/gradient function is compiled; the
                  gradient all-reduce, loss all-sum and the update stay eager;
  full-step       one process, one micro-step: gradient, clipping and update in one compiled call;
  fallback-eager  compiling failed on some rank and every rank went back to eager.

A compiled call that raises is re-run eagerly on the same inputs: if eager works too, the
failure was the compiler's (``CompileFailed``); if eager fails, the model's own error is raised
as itself. A failed trace leaves tracers in the model, so its arrays are restored first.
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


def clip(grads: Any, max_norm: float) -> tuple[Any, Any]:
    import mlx.core as mx
    import mlx.optimizers as optim

    if max_norm > 0:
        return optim.clip_grad_norm(grads, max_norm)
    from mlx.utils import tree_flatten

    return grads, mx.sqrt(sum((g.astype(mx.float32) ** 2).sum() for _, g in tree_flatten(grads)))


class LocalStep:
    """Runs micro-batches through the model in the scenario's compile mode."""

    def __init__(self, model: Any, optimizer: Any, spec: TrainSpec, world_size: int):
        import mlx.core as mx
        import mlx.nn as nn

        self.model, self.optimizer, self.spec = model, optimizer, spec
        self.mode = spec.compile
        self.fallback_reason: str | None = None
        self.full_step = self.mode != "off" and world_size == 1 and spec.grad_accum == 1
        self._vg = nn.value_and_grad(model, loss_fn)
        optimizer.init(model.trainable_parameters())
        self._grad_c = mx.compile(self._grad, inputs=[model.state], outputs=[model.state])
        state = [model.state, optimizer.state]
        self._full_c = mx.compile(self._full, inputs=state, outputs=state)

    @property
    def scope(self) -> str:
        if self.fallback_reason is not None:
            return "fallback-eager"
        if self.mode == "off":
            return "none"
        return "full-step" if self.full_step else "local-grad"

    @property
    def compiled(self) -> bool:
        return self.mode != "off" and self.fallback_reason is None

    def fall_back(self, reason: str) -> None:
        self.fallback_reason = reason

    def _grad(self, batch: dict[str, Any], scale: Any, fault: str | None) -> Any:
        (_, loss_sum), grads = self._vg(self.model, batch, scale, fault)
        return loss_sum, grads

    def _full(self, batch: dict[str, Any], scale: Any, fault: str | None) -> Any:
        loss_sum, grads = self._grad(batch, scale, fault)
        grads, norm = clip(grads, self.spec.max_grad_norm)
        self.optimizer.update(self.model, grads)
        return loss_sum, norm

    def _guarded(self, compiled: Any, args: tuple) -> Any:
        """Call a compiled function; tell a compile failure from the model's own error."""
        import mlx.core as mx
        from mlx.utils import tree_map

        # Every array the model holds (parameters and cached buffers such as RoPE frequencies):
        # a failed trace can leave tracers in any of them.
        state = tree_map(lambda a: a, self.model.state)
        # Only the full step updates the optimizer inside the compiled call.
        opt_state = tree_map(lambda a: a, self.optimizer.state) if compiled is self._full_c else None
        try:
            out = compiled(*args)
            mx.eval(out)
            return out
        except Exception as compile_error:  # noqa: BLE001 - classified just below
            restore_in_place(self.model, state)
            if opt_state is not None:
                restore_in_place(self.optimizer.state, opt_state)
            eager = self._grad(*args)  # the model's own error propagates from here
            mx.eval(eager)
            raise CompileFailed(str(compile_error)) from compile_error

    def grad(self, batch: dict[str, Any], scale: Any, fault: str | None) -> tuple[Any, Any]:
        """(token-loss sum, gradients of sum x scale) of one micro-batch, evaluated."""
        import mlx.core as mx

        args = (batch, scale, fault)
        if self.compiled and not self.full_step:
            return self._guarded(self._grad_c, args)
        out = self._grad(*args)
        mx.eval(out)
        return out

    def full(self, batch: dict[str, Any], scale: Any, fault: str | None) -> tuple[Any, Any]:
        """Gradient, clipping and update in one compiled call (``full-step`` scope)."""
        return self._guarded(self._full_c, (batch, scale, fault))

    def update(self, grads: Any) -> Any:
        """Clip the (already all-reduced) gradients and apply them; returns the gradient norm."""
        grads, norm = clip(grads, self.spec.max_grad_norm)
        self.optimizer.update(self.model, grads)
        return norm
