"""The collective ledger: every call a rank makes into MLX's collectives, in order.

Installed in every Python rank before anything joins the group (``harness.rank.entry``), it
wraps ``mx.distributed``'s collectives (``all_sum``, ``all_gather``, ``all_max``, ``all_min``,
``sum_scatter``, ``send``, ``recv``, ``recv_like``; ``nn.average_gradients`` calls ``all_sum``) so
that each call appends one line to ``rank{r}.collectives.jsonl`` before it is issued: its
sequence number, op, shape, dtype, stream, group size, peer, the training step in progress and
the call site (the first frame outside MLX and the harness, else outside MLX). Lines are flushed
as they are written, so a rank that hangs or is killed inside a collective leaves its ledger up
to that call (a call recorded while MLX built a lazy graph that was then dropped unevaluated is
retracted by a later line, ``on_event``). ``mx.compile`` is wrapped too: MLX runs a compiled
function's Python only when it traces it, so its collectives are recorded then (with
``compiled``: the function and its call number) and every later call that does not trace records
them again from that trace, so a compiled step's ledger reads like an eager one's.
``MLX_DDP_HARNESS_LEDGER=0`` in the controller's environment keeps no ledger (``enabled``; what it costs is measured by
``benchmarks/ledger_overhead.py``). A run's collective mutation acts here too
(``harness.rank.collective_mutations``). The controller compares the ranks' ledgers after every
run of more than one rank (``harness.controller.ledgers``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

from harness import ablation
from harness.rank.collective_mutations import CollectiveMutation, is_gradient, is_measuring

OPS = ("all_sum", "all_gather", "all_max", "all_min", "sum_scatter", "send", "recv", "recv_like")
HARNESS = tuple({str(p) + os.sep for p in (Path(__file__).parents[1], Path(__file__).resolve().parents[1])})
SWITCH = "MLX_DDP_HARNESS_LEDGER"


def enabled() -> bool:
    """Whether ranks keep a ledger (``MLX_DDP_HARNESS_LEDGER=0`` turns it off, and so does the
    observer benchmark's ``ledger`` part: ``harness.ablation``)."""
    return os.environ.get(SWITCH, "1") != "0" and ablation.on("ledger")


def _mlx_dir() -> tuple[str, ...]:
    import mlx

    here = Path(list(mlx.__path__)[0])
    return tuple({str(p) + os.sep for p in (here, here.resolve())})  # with the separator: not mlx_lm's


def call_site(mlx_dir: tuple[str, ...]) -> tuple[str, bool]:
    """``file:line in function`` of the first caller outside MLX and the harness, else the first
    outside MLX (the harness's own trainers); and whether it is outside the harness."""
    frame = sys._getframe(2)  # noqa: SLF001 - the wrapper's caller
    first = None  # the first frame outside MLX, named only once the walk ends (a harness trainer's
    while frame is not None:  # stack is harness frames to its top: naming each cost ~5 us a frame)
        path = frame.f_code.co_filename
        if not path.startswith(mlx_dir) and path != __file__ and not path.startswith("<frozen"):
            if not path.startswith(HARNESS):
                return site_name(frame), True
            if first is None:
                first = frame
        frame = frame.f_back
    return (site_name(first) if first is not None else "unknown"), False


def site_name(frame: Any) -> str:
    """``file:line in function`` of ``frame``."""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def stream_name(stream: Any) -> str | None:
    """``cpu`` for ``mx.cpu`` (a device type), else the stream or device as MLX prints it."""
    return None if stream is None else str(stream).replace("DeviceType.", "")


class Ledger:
    """One rank's ledger file; ``step`` is the training step in progress (set from its events)."""

    def __init__(self, path: Path, world_size: int, rank: int = 0, mutation: CollectiveMutation | None = None):
        self.path, self.world_size, self.rank, self.mutation = path, world_size, rank, mutation
        self.seq, self.step = 0, 0
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()
        self._mlx = _mlx_dir()
        self._originals: dict[str, Any] = {}
        self._trace: list[dict[str, Any]] | None = None  # collectives of the trace in progress
        self._compiled: list[str] = []
        self._recent: list[tuple[int, Any, bool]] = []  # (seq, step, compiled) of the last step's compiled calls
        self.block: int | None = None  # recording only in alternate blocks of this many steps (``alternate``)
        self.passing = False  # in a block without recording: every wrapper passes its call straight through

    def alternate(self, block: int) -> None:
        """Record in steps 1 to ``block``, not in the next ``block``, and so on (a benchmark's measure
        of what recording costs a step, ``harness.ablation.alternating``). In a block without, each
        wrapper calls MLX at once; the wrappers themselves stay (MLX's compiled functions hold
        theirs), so what the blocks differ by is the recording, not the interposition's frames."""
        self.block = block

    def record(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Write the call's line; whether the run's collective mutation acts on it."""
        x = args[0] if args else kwargs.get("x", kwargs.get("like"))
        shape = kwargs.get("shape") if op == "recv" else getattr(x, "shape", None)
        if op == "recv" and shape is None and args:
            shape = args[0]
        dtype = kwargs.get("dtype") if op == "recv" else getattr(x, "dtype", None)
        if op == "recv" and dtype is None and len(args) > 1:
            dtype = args[1]
        group = kwargs.get("group")
        peer = kwargs.get("dst", kwargs.get("src"))
        at = {"send": 1, "recv_like": 1, "recv": 2}.get(op)
        if peer is None and at is not None and len(args) > at:
            peer = args[at]
        entry = {"seq": self.seq, "op": op, "shape": list(shape) if shape is not None else None,
                 "dtype": str(dtype).replace("mlx.core.", "") if dtype is not None else None,
                 "stream": stream_name(kwargs.get("stream")),
                 "group": group.size() if group is not None else self.world_size, "peer": peer,
                 "step": self.step}
        entry["site"], external = call_site(self._mlx)
        mutate = bool(self.mutation and op == "all_sum" and external and is_gradient(x) and not is_measuring())
        if mutate:
            entry["mutation"] = self.mutation.name
        if self._trace is not None:  # MLX is tracing a compiled function: later calls replay this
            self._trace.append(entry)
            entry = {**entry, "compiled": self._compiled[-1]}
        self._write(entry)
        if mutate and self._trace is None:
            self.mutation.arrive(self.step, entry["site"])
        return mutate

    def _write(self, entry: dict[str, Any]) -> None:
        with self._lock:
            entry["seq"] = self.seq
            self.seq += 1
            if entry.get("compiled"):  # the compiled calls of the step in progress, for a retraction
                if self._recent and self._recent[-1][1] != entry.get("step"):
                    self._recent = []
                self._recent.append((entry["seq"], entry.get("step"), True))
            self._f.write(json.dumps(entry, separators=(",", ":")) + "\n")

    def compile(self, original: Any, fun: Any, *args: Any, **kwargs: Any) -> Any:
        """``mx.compile(fun, ...)``, recording the collectives of each trace and replaying them on
        every call that does not trace."""
        name = getattr(fun, "__name__", "compiled")
        state: dict[str, Any] = {"trace": [], "traced": False, "calls": 0}

        def traced(*a: Any, **kw: Any) -> Any:
            outer, self._trace = self._trace, []
            self._compiled.append(f"{name}#{state['calls']}")
            try:
                return fun(*a, **kw)
            finally:
                state["trace"], state["traced"] = self._trace, True
                self._trace = outer
                self._compiled.pop()

        compiled = original(traced, *args, **kwargs)

        def call(*a: Any, **kw: Any) -> Any:
            if self.passing:
                return compiled(*a, **kw)
            state["calls"] += 1
            state["traced"] = False
            mutated = next((e for e in state["trace"] if e.get("mutation")), None)
            if mutated is not None:  # the step holds a mutated all-reduce: a timed mutation acts as it is called
                self.mutation.arrive(self.step, mutated["site"])
            out = compiled(*a, **kw)
            if not state["traced"]:
                for e in state["trace"]:
                    replay = {**e, "step": self.step, "compiled": f"{name}#{state['calls']}"}
                    if self._trace is not None:
                        self._trace.append(replay)
                    self._write(replay)
            return out

        return call

    def install(self) -> None:
        """Wrap ``mx.distributed``'s collectives (each once; ``uninstall`` puts them back)."""
        import mlx.core as mx

        for op in OPS:
            original = getattr(mx.distributed, op, None)
            if original is None or op in self._originals:
                continue
            self._originals[op] = original

            def wrapper(*args: Any, _op: str = op, _original: Any = original, **kwargs: Any) -> Any:
                if self.passing:
                    return _original(*args, **kwargs)
                if self.record(_op, args, kwargs):
                    return self.mutation.all_sum(_original, args, kwargs)
                return _original(*args, **kwargs)

            setattr(mx.distributed, op, wrapper)
        if "compile" not in self._originals:
            self._originals["compile"] = original_compile = mx.compile

            def compile_wrapper(fun: Any, *args: Any, **kwargs: Any) -> Any:
                return self.compile(original_compile, fun, *args, **kwargs)

            mx.compile = compile_wrapper

    def uninstall(self) -> None:
        import mlx.core as mx

        for op, original in self._originals.items():
            setattr(mx if op == "compile" else mx.distributed, op, original)
        self._originals.clear()
        with self._lock:
            self._f.close()

    def on_event(self, kind: str, fields: dict[str, Any]) -> None:
        """Step 0 is start-up (the device check, the group's first exchanges); the ``start`` event
        begins step 1, and a ``step`` event that ended step k begins step k + 1. A
        ``compile_fallback`` event (the reference trainer's agreed compile failure) retracts the
        compiled calls of its step: their lazy graph was dropped unevaluated, so no backend saw
        them (a ``retract`` line naming their sequence numbers)."""
        if kind == "compile_fallback":
            with self._lock:
                dropped = [seq for seq, step, compiled in self._recent if compiled and step == self.step]
            if dropped:
                self._write({"op": "retract", "retracts": dropped, "step": fields.get("step"),
                             "site": "compile fallback"})
        elif kind == "start":
            self.step = max(self.step, 1)
        elif kind == "step" and isinstance(fields.get("step"), int):
            self.step = fields["step"] + 1
            if self.block is not None:
                self.passing = ((self.step - 1) // self.block) % 2 == 1
