"""One machine's memory, shared among its ranks: the working set, the memory budget, each rank's
share, and what a launch is expected to hold (both sides of the process boundary read it).

*Working set*: what the device may hold. On a Mac, Metal's ``max_recommended_working_set_size``
(what mlx-lm wires; also for ranks on the CPU device, whose memory is the same); on CUDA, the
GPUs' memory, each rank's share taken from the GPU it runs on; elsewhere, the machine's physical
memory (psutil).

*Budget*: the memory every launch on this machine shares: ``--memory-budget`` /
``MLX_DDP_HARNESS_MEMORY_BUDGET`` (e.g. ``6GB``, ``512MB``), else the working set; a scenario's
``[limits] memory_budget_mb`` lowers it for its own runs. A rank's *share* is the budget (where
one is given, else its host's working set) divided by the ranks on its host
(``harness.memory.share`` caps MLX's memory limits at it; the ``wired_share`` check holds
each rank to it).

*Expected peak* of a rank (``expected_rank_bytes``): the scenario's ``[checks]`` ceiling
(``max_mlx_mb``, ``max_rss_mb``: the larger) where given, else an estimate from the model:
``ESTIMATE_COPIES`` copies of its parameters in its dtype (weights, gradients, Adam's two moments;
one copy under LoRA, whose frozen weights have neither; a local model's weights as its safetensors
hold them) times ``ESTIMATE_MARGIN``, plus ``ESTIMATE_FIXED_MB`` for activations, batches and MLX's
cache.
The rank's runtime (Python, MLX's device runtime, libraries) is not counted. The machine's rank
budget (``harness.controller.rank_budget``) admits a launch only while its ranks' expected peaks
fit the budget beside the launches running.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MB = 1024 * 1024
BUDGET_VAR = "MLX_DDP_HARNESS_MEMORY_BUDGET"
WORKING_SET_KEY = "max_recommended_working_set_size"
UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": MB, "mb": MB, "mib": MB,
         "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ESTIMATE_COPIES = 4  # weights, gradients, Adam's first and second moments
ESTIMATE_MARGIN = 1.5
ESTIMATE_FIXED_MB = 64
# The tiny default shapes of harness/rank/models.py (TINY) and harness/rank/vision.py (TEXT, TINY_VLM)
# where a scenario's [model.config] does not set them (tests/test_memory_share.py holds them equal).
TEXT_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
VISION_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2}
DEFAULT_VOCAB = 32768  # a tokenizer whose size cannot be read cheaply


def parse_size(text: str) -> int:
    """``"6GB"``, ``"512MB"``, ``"1.5 GiB"``, ``"1048576"`` as bytes (units are powers of 1024);
    ``ValueError`` naming the text otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"memory size {text!r}: give a positive number with a unit, e.g. 6GB or 512MB")
    return int(float(m.group(1)) * UNITS[unit])


def format_size(n: float) -> str:
    """Bytes as ``"12.5 GB"`` or ``"256 MB"`` (powers of 1024)."""
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / MB:.0f} MB"


def share_of(budget: int, ranks_on_host: int) -> int:
    """A rank's share of ``budget`` among ``ranks_on_host`` ranks."""
    return int(budget) // max(1, int(ranks_on_host))


@dataclass(frozen=True)
class WorkingSet:
    """What the machine's devices may hold, in bytes, and where that figure comes from; ``units``:
    the GPUs it is spread over (CUDA), each holding ``bytes / units``."""

    bytes: int
    source: str
    units: int = 1

    def share(self, ranks_on_host: int) -> int:
        """A rank's share where no budget is given: its unit's memory among the ranks on it (ranks
        spread over the GPUs: one per GPU with nccl, rank r on GPU r mod count with ring)."""
        per_unit = self.bytes // max(1, self.units)
        return per_unit // max(1, -(-int(ranks_on_host) // max(1, self.units)))


def working_set_of(info: dict[str, Any], cuda: bool, gpus: int = 1) -> WorkingSet:
    """The working set from the GPU's own ``mx.device_info(mx.gpu)`` where there is a GPU, else
    the CPU's (``info``, never a wrapped one); ``gpus``: the CUDA GPUs of the host."""
    if info.get(WORKING_SET_KEY):
        return WorkingSet(int(info[WORKING_SET_KEY]), f"Metal's recommended working set (mx.device_info "
                                                      f"{WORKING_SET_KEY})")
    memory = info.get("total_memory") or info.get("memory_size")
    if cuda and memory:
        n = max(1, int(gpus))
        what = "the GPU's memory" if n == 1 else f"{n} GPUs x {format_size(int(memory))}"
        return WorkingSet(int(memory) * n, f"{what} (mx.device_info)", n)
    import psutil

    return WorkingSet(int(psutil.virtual_memory().total), "the machine's physical memory (psutil)")


def device_info_of_machine(mx: Any) -> dict[str, Any]:
    """``mx.device_info`` of this machine's GPU where MLX has one, whatever the default device (a
    Mac's CPU and GPU share one memory, and Metal's wired limit is the GPU's), else of the CPU."""
    gpu = bool(mx.cuda.is_available()) or bool(mx.metal.is_available())
    try:
        return dict(mx.device_info(mx.gpu if gpu else mx.cpu))
    except Exception:  # device_info is not on every build
        return {}


@functools.lru_cache(maxsize=1)
def machine_working_set() -> WorkingSet:
    """This machine's working set (MLX imported here): on CUDA every GPU's."""
    import mlx.core as mx

    cuda = bool(mx.cuda.is_available())
    return working_set_of(device_info_of_machine(mx), cuda, int(mx.device_count(mx.gpu)) if cuda else 1)


def budget_from_env() -> int | None:
    """``MLX_DDP_HARNESS_MEMORY_BUDGET`` in bytes, or None where unset; ``ValueError`` naming it."""
    raw = os.environ.get(BUDGET_VAR, "").strip()
    if not raw:
        return None
    try:
        return parse_size(raw)
    except ValueError as e:
        raise ValueError(f"{BUDGET_VAR}: {e}") from None


@dataclass(frozen=True)
class Budget:
    """A run's memory budget in bytes; ``given``: set by the user (else the working set)."""

    bytes: int
    source: str
    given: bool


def machine_budget() -> Budget:
    """The budget every launch on this machine shares: the variable (``--memory-budget``), else the
    working set."""
    given = budget_from_env()
    if given is not None:
        return Budget(given, f"{BUDGET_VAR} / --memory-budget", True)
    ws = machine_working_set()
    return Budget(ws.bytes, f"the working set: {ws.source}", False)


@dataclass(frozen=True)
class Footprint:
    """What one rank of a run is expected to hold is worked out from (the plan fills it from the
    run's effective settings, ``harness.scenario.runs``): the ``[checks]`` ceilings set, as
    (MB, key); the model (``arch``, ``vision``, a local ``path``, ``config``, the ``dtype`` it
    is built in); the tokenizer (``tokenizer``, relative to ``base_dir``); whether it trains
    LoRA adapters; and ``[limits] memory_budget_mb``."""

    ceilings: tuple[tuple[float, str], ...]
    arch: str
    vision: bool
    path: str | None
    config: dict[str, Any]
    dtype: str
    tokenizer: str
    base_dir: str | None
    lora: bool
    budget_mb: float | None


def run_budget(f: Footprint) -> Budget:
    """The budget a scenario's runs share: the machine's, or the scenario's ``[limits]
    memory_budget_mb`` where lower."""
    machine = machine_budget()
    mb = f.budget_mb
    if mb is not None and mb * MB < machine.bytes:
        return Budget(int(mb * MB), "[limits] memory_budget_mb", True)
    return machine


def _vocab(f: Footprint, config: dict[str, Any]) -> int:
    if config.get("vocab_size"):
        return int(config["vocab_size"])
    tok = f.tokenizer
    if tok == "byte":
        return 259
    if tok.startswith("bpe:") and tok[4:].isdigit():
        return int(tok[4:])
    try:
        path = Path(tok)
        if f.base_dir is not None and not path.is_absolute():
            path = Path(f.base_dir) / path
        return len(json.loads(path.read_text())["model"]["vocab"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_VOCAB


def _block_params(section: dict[str, Any], shape: dict[str, int]) -> int:
    """A transformer stack's parameters: per layer 4 h^2 (attention) + 3 h i (gated MLP)."""
    merged = {**shape, **{k: v for k, v in section.items() if isinstance(v, int | float)}}
    h = int(merged.get("embed_dim") or merged["hidden_size"])
    layers = int(merged.get("depth") or merged["num_hidden_layers"])
    inner = int(merged.get("intermediate_size") or float(merged.get("mlp_ratio") or 4) * h)
    return layers * (4 * h * h + 3 * h * inner)


def param_estimate(f: Footprint) -> tuple[int, str]:
    """(parameters, how they were counted) of the run's model, without building it."""
    if f.path:
        files = list(Path(f.path).glob("*.safetensors"))
        size = sum(p.stat().st_size for p in files if p.is_file())
        return size // 2, f"{f.path}: {format_size(size)} of safetensors"
    config = dict(f.config)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab = _vocab(f, text)
    n = _block_params(text, TEXT_SHAPE) + 2 * vocab * int(text.get("hidden_size") or TEXT_SHAPE["hidden_size"])
    if f.vision:
        vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else {}
        n += _block_params(vision, VISION_SHAPE)
    return n, f"about {n / 1e6:.2f}M parameters of {f.arch} ({vocab} tokens)"


def expected_rank_bytes(f: Footprint) -> tuple[int, str]:
    """(bytes, why) one rank of the run is expected to peak at (the module's docstring)."""
    if f.ceilings:
        mb, key = max(f.ceilings)
        return int(mb * MB), f"the ceiling [checks] {key} = {mb:g}"
    params, how = param_estimate(f)
    copies, what = (1, "the frozen weights; LoRA's adapters in the margin") if f.lora else (
        ESTIMATE_COPIES, "weights, gradients, Adam's moments")
    if f.path:  # the weights as stored (quantized ones included)
        weights = params * 2
    else:
        b = DTYPE_BYTES.get(f.dtype, 4)
        weights, how = params * b, f"{how} x {b} bytes"
    est = int(weights * copies * ESTIMATE_MARGIN) + ESTIMATE_FIXED_MB * MB
    return est, f"estimated: {how} x {copies} ({what}) x {ESTIMATE_MARGIN:g} + {ESTIMATE_FIXED_MB} MB"


def job_memory(f: Footprint) -> dict[str, Any]:
    """What a run's job file says of memory: the budget where one is given (``None``: each rank
    takes its host's working set), its source, and one rank's expected peak; a bad
    ``MLX_DDP_HARNESS_MEMORY_BUDGET`` is a ``ValueError`` (one line)."""
    budget = run_budget(f)
    expected, why = expected_rank_bytes(f)
    return {"budget_bytes": budget.bytes if budget.given else None, "budget_source": budget.source,
            "expected_rank_bytes": expected, "expected_source": why}


def launch_problem(run: str, world_size: int, f: Footprint) -> str | None:
    """Why ``run``'s ranks can never fit the memory budget on one machine, or None."""
    budget = run_budget(f)
    expected, why = expected_rank_bytes(f)
    total = expected * world_size
    if total <= budget.bytes:
        return None
    declare = "" if why.startswith("the ceiling") else "; [checks] max_mlx_mb states a rank's peak instead"
    return (f"run {run}: its {world_size} rank(s) are expected to peak at {format_size(total)} "
            f"({why} per rank), more than the memory budget of {format_size(budget.bytes)} ({budget.source})"
            f"{declare}")


def first_launch_problem(runs: Iterable[tuple[str, int, Footprint]]) -> str | None:
    """The first of ``runs`` (name, world size, footprint) that can never fit (``launch_problem``)."""
    return next((problem for name, n, f in runs if (problem := launch_problem(name, n, f))), None)
