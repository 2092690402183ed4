"""A user's script's session in its rank (``harness.api`` is its public face and says how a
script uses it): the scenario's settings and inputs, and the report calls, written as records of
the rank protocol. The script trainer (``harness.trainers.script``) activates one per rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_current: Session | None = None


class NotUnderHarness(RuntimeError):
    """``session()`` was called in a process the harness did not start."""


class Session:
    """One rank's view of the run: the scenario's settings, its inputs, and the report calls."""

    def __init__(self, ctx: Any, scenario: Any, reporter: Any, writer: Any, pump: Any):
        self._ctx, self.scenario, self._rep = ctx, scenario, reporter
        self._out, self._pump = writer, pump  # the protocol's writer; ``pump`` reads what it wrote
        self._steps = self._saves = 0
        self.started = False  # the script said what training starts from (``split`` or ``start``)
        self.final: Any = None  # the final parameters ``finish`` was handed
        self.used = False  # the script asked for its session
        self.model_config: dict[str, Any] | None = None  # the scenario's model's, once ``model`` built it
        self.rank: int = ctx.rank
        self.world_size: int = ctx.world_size
        self.group: Any = ctx.group
        self.seed: int = scenario.seed
        self.steps: int = scenario.train.steps
        self.global_batch: int = scenario.train.global_batch
        self.learning_rate: float = scenario.train.learning_rate
        self.split_rows: int = int(ctx.job.split_rows or 1)
        self.run_dir: Path = Path(ctx.run_dir)

    def model(self, loss_scale: str = "global") -> Any:
        """The scenario's ``[model]``, with seeded weights (the same on every rank); with
        ``[trainer] fine_tune = "lora"``, frozen, with mlx-lm's LoRA adapters on its last
        ``lora_layers`` blocks (the adapters are what trains: ``model.trainable_parameters()``).
        ``loss_scale``: as ``split``'s."""
        from harness.data.tokenizers import load_tokenizer
        from harness.rank.models import apply_lora, build_model

        model, self.model_config = build_model(self.scenario.model, load_tokenizer(self.scenario.data).vocab_size,
                                               self.seed)
        if self.scenario.trainer.fine_tune == "lora":
            apply_lora(model, self.scenario)
        return self.split(model, loss_scale)

    def split(self, model: Any, loss_scale: str = "global") -> Any:
        """``model`` itself; in the noise-floor run, with its forward computing each batch in
        ``split_rows`` row chunks (the same logits; the rounding of that many ranks). Training
        is taken to start from its parameters as they are now (``start``). ``loss_scale``:
        "global" where each rank scales its loss as one process does (a token sum, or a sum over
        the global token count, divided after the all-reduce or before the gradient alike),
        "rank" where each rank divides its loss by its own token count before the gradient (its
        ranks then carry every activation's gradient at their own scale, and the floor does too)."""
        from harness.rank.context import ReportedFailure
        from harness.rank.split_floor import is_split, rounded_outputs, split_floor, split_text_model

        if loss_scale not in ("global", "rank"):
            raise ReportedFailure(f"{self._rep.name}: run.split's loss_scale is {loss_scale!r}: \"global\" or \"rank\"")
        plan = split_floor(self._ctx.job, self.seed, outputs=loss_scale == "rank")
        if plan is not None and not is_split(model):
            split_text_model(model, plan)
        elif plan is not None and plan.outputs:  # split already (by run.model()): its loss scale said now
            rounded_outputs(model)
        self._rep.saw_model(model)
        self.start(model.parameters())
        return model

    def start(self, params: Any) -> None:
        """Training starts from ``params``: every run compared must start from the same ones
        (call it again after changing them, e.g. after broadcasting rank 0's weights). From
        here on, training must leave the global RNGs (numpy's and MLX's) as they are."""
        import mlx.core as mx

        from harness import ablation
        from harness.rank.models import start_digest
        from harness.rank.precision import coarsest_dtype, param_dtypes

        mx.eval(params)  # on every rank alike: weights that are a collective's result must not be computed on one
        digest = start_digest(params, self._ctx.job.digest_start)
        if self.rank == 0 and self._ctx.job.keep_start and ablation.on("start"):  # the run the others are compared with
            self._out.params(params, "start_params")
        dtype = {"dtype": d} if (d := coarsest_dtype(params)) else {}
        taken = {"digest": digest} if digest is not None else {}
        self._out.event("start", rank=self.rank, world_size=self.world_size, **taken, **dtype,
                        dtypes=param_dtypes(params))
        self.started = True
        self._pump()

    def rows(self, split: str = "train") -> list[tuple[Any, Any]]:
        """The scenario's ``[data]`` rows of ``split`` ("train" or "eval"), tokenized: a list of
        (int32 token ids, bool mask of the tokens that are training targets)."""
        from harness.data.rows import split_rows
        from harness.data.tokenizers import load_tokenizer

        tok = load_tokenizer(self.scenario.data)
        return [(e.ids, e.supervised) for _, e in split_rows(self.scenario, tok, split)]

    def optimizer(self) -> Any:
        """The scenario's ``[train]`` optimizer (AdamW or SGD) with its learning rate, schedule and weight decay."""
        from harness.rank.optimizer import build_optimizer

        return build_optimizer(self.scenario.train)

    def probe(self, step: int, model: Any, fn: Any, *args: Any) -> None:
        """Before step ``step``'s update: ``fn(*args)`` computes ``(global loss, all-reduced
        gradient, global supervised tokens)`` at ``model``'s parameters (module docstring)."""
        def compute() -> tuple[Any, Any, int]:
            import mlx.core as mx

            from harness.rank.context import ReportedFailure

            out = fn(*args)
            if not isinstance(out, tuple | list) or len(out) != 3 or not isinstance(out[1], dict):
                raise ReportedFailure(f"{self._rep.name}: run.probe's function returned {type(out).__name__}; it must "
                                      f"return (global loss, all-reduced gradient tree (a dict), global tokens)")
            loss, grads, tokens = out
            return mx.array(loss), grads, int(tokens.item() if hasattr(tokens, "item") else tokens)

        def micros() -> list[tuple[Any, Any, Any]] | None:  # the step's rows, where the harness can read them
            from harness.rank.defects import canonical

            return [tuple(args)] if canonical(tuple(args)) else None

        if step == 1 or step in self._rep.probes.steps:  # the model it computes with, frozen weights included
            self._rep.saw_model(model)
        self._rep.probe(step, model, compute, micros)

    def step(self, step: int, loss: float, tokens: int, tokens_local: int, lr: float | None = None,
             params: Any = None) -> None:
        """Optimizer step ``step`` (1, 2, ...) is done; ``params``: the parameters after it."""
        fields: dict[str, Any] = {"step": int(step), "loss": float(loss), "tokens_global": int(tokens),
                                  "tokens_local": int(tokens_local)}
        if lr is not None:
            fields["lr"] = float(lr)
        every = self.scenario.train.digest_every
        if params is not None and every and int(step) % every == 0:
            from harness.rank.models import tree_digest

            fields["digest"] = tree_digest(params)
        self._out.event("step", **fields)
        self._steps = int(step)
        self._pump()

    def eval(self, step: int, loss: float, tokens: int) -> None:
        """An evaluation after ``step`` steps: its global loss and supervised token count."""
        self._out.event("eval", step=int(step), loss=float(loss), tokens=int(tokens))
        self._pump()

    def saved(self, count: int = 1) -> None:
        """This rank wrote ``count`` files of the script's own (weights, checkpoints)."""
        self._saves += int(count)

    def finish(self, params: Any) -> None:
        """Training is over; ``params`` are the final parameters, handed to the rank in memory
        (``final``: the script runs in the rank's process, so it writes no parameter file)."""
        import mlx.core as mx
        from mlx.utils import tree_flatten

        flat = tree_flatten(params)
        stray = next((k for k, v in flat if not isinstance(v, mx.array)), None)
        if stray is not None or not flat:
            what = f"{stray} is not an MLX array" if stray is not None else "holds no MLX arrays"
            raise TypeError(f"run.finish(params): {what} (pass model.parameters())")
        self.final = params
        self._out.result(status="ok", steps=self._steps, saves=self._saves)


def session() -> Session:
    """This rank's session; raises ``NotUnderHarness`` outside a harness run."""
    if _current is None:
        raise NotUnderHarness("not running under mlx-ddp-harness: run this script through a scenario with "
                              "[trainer] kind = \"script\"")
    _current.used = True
    return _current


def activate(s: Session | None) -> None:
    """Make ``s`` the session ``session()`` returns (None: no session, outside a script run)."""
    global _current
    _current = s
