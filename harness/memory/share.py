"""A rank's share of its machine's memory, and every memory limit set in the rank, capped at it.

mlx-lm's trainer (and mlx-vlm's functional recipes) call ``mx.set_wired_limit(<the device's
recommended working set>)`` in every rank: N ranks on one Mac each wire up to the whole set, which
upstream ties to kernel panics. ``install`` runs in every Python rank (the reference trainer, the
adapters, a user's script, which runs in the rank process) before its trainer is imported:

- The machine's working set (``harness.memory.plan``: Metal's recommended working set, a CUDA GPU's
  memory, or the machine's physical memory) and the rank's *share*: the job's memory budget
  where one is given, else the working set, divided by the ranks on the rank's host (the job's
  ``memory.ranks_on_host``; the world size where the job does not say).
- ``mx.set_wired_limit``, ``mx.set_memory_limit`` and ``mx.set_cache_limit`` (and their
  ``mx.metal`` aliases) are wrapped: each call is recorded (which limit, the bytes asked, the
  bytes set, the calling module) and passed on to MLX capped at the share; the wrapper returns
  what MLX returns.
- ``mx.device_info`` (and ``mx.metal.device_info``) is wrapped: where the device reports no
  ``max_recommended_working_set_size`` (the CPU, CUDA), it reports the machine's working set under
  that key, as Metal does (on a Mac, Metal's own, also for the CPU device: Metal refuses a wired
  limit above it, so none is set above it either). A trainer that sizes its wired limit by it
  (mlx-lm) then asks on Linux as it would on a Mac, and the cap is seen working there, where
  MLX's limit functions exist and do nothing.

The rank's result holds the working set, the share and the calls (``memory_share``); the judge's
``wired_share`` check holds the rank to its share. An executable under ``[trainer] kind =
"command"`` is its own process: nothing is installed for it. Nothing here draws random numbers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from harness.memory.plan import WORKING_SET_KEY, device_info_of_machine, share_of, working_set_of

LIMITS = ("wired", "memory", "cache")


class Placed(Protocol):
    """What a share is taken from: a launched job's ``memory`` block and world size
    (``harness.scenario.job.Job``)."""

    memory: dict[str, Any]
    world_size: int | None


@dataclass
class LimitCall:
    """One call of an MLX memory-limit function in the rank."""

    limit: str  # "wired", "memory" or "cache"
    function: str  # e.g. "mx.set_wired_limit"
    asked: int
    set: int
    caller: str  # the calling module


@dataclass
class MemoryShare:
    """The rank's share and the calls made under it."""

    working_set_bytes: int
    working_set_source: str
    budget_bytes: int | None
    budget_source: str
    ranks_on_host: int
    share_bytes: int
    calls: list[LimitCall] = field(default_factory=list)
    wired_max_bytes: int | None = None  # Metal refuses a wired limit above its recommended working set

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_ORIGINALS: list[tuple[Any, str, Any]] = []  # (namespace, name, original) of what ``install`` replaced
_STATE: MemoryShare | None = None


def _caller(depth: int = 2) -> str:
    try:
        return str(sys._getframe(depth).f_globals.get("__name__", "?"))
    except ValueError:
        return "?"


def _capped(state: MemoryShare, limit: str, function: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def set_limit(*args: Any, **kwargs: Any) -> Any:
        if not args and "limit" not in kwargs:
            return real(*args, **kwargs)  # MLX's own error for a call without a limit
        asked = int(args[0] if args else kwargs.pop("limit"))
        granted = min(asked, state.share_bytes)
        if limit == "wired" and state.wired_max_bytes is not None:
            granted = min(granted, state.wired_max_bytes)
        state.calls.append(LimitCall(limit, function, asked, granted, _caller()))
        return real(granted, *args[1:], **kwargs)

    set_limit.__doc__ = f"{function}, capped at this rank's memory share (harness.memory.share)."
    return set_limit


def _reporting(state: MemoryShare, real: Callable[..., Any]) -> Callable[..., Any]:
    def device_info(*args: Any, **kwargs: Any) -> Any:
        info = real(*args, **kwargs)
        if WORKING_SET_KEY in info:
            return info
        return {**info, WORKING_SET_KEY: state.wired_max_bytes or state.working_set_bytes}

    device_info.__doc__ = "mx.device_info, reporting the machine's working set where the device does not."
    return device_info


def _replace(namespace: Any, name: str, make: Callable[[Any], Callable[..., Any]]) -> None:
    real = getattr(namespace, name, None)
    if real is None:
        return
    _ORIGINALS.append((namespace, name, real))
    setattr(namespace, name, make(real))


def install(job: Placed, rank: int) -> MemoryShare:
    """Take this rank's share from ``job`` (its ``memory`` block and world size) and wrap MLX's
    limit functions and ``device_info`` (the module's docstring). Installing again first undoes
    the last install."""
    global _STATE
    import mlx.core as mx

    uninstall()
    info = device_info_of_machine(mx)
    memory = job.memory
    ws = working_set_of(info, bool(mx.cuda.is_available()), int(memory.get("gpus_on_host") or 1))
    world = int(job.world_size or 1)
    hosts = memory.get("ranks_on_host")
    on_host = int(hosts[rank]) if isinstance(hosts, list) and rank < len(hosts) else world
    budget = memory.get("budget_bytes")
    share = share_of(int(budget), on_host) if budget else ws.share(on_host)
    state = MemoryShare(ws.bytes, ws.source, int(budget) if budget else None,
                        str(memory.get("budget_source") or "the working set") if budget else "the working set",
                        on_host, share, wired_max_bytes=info.get(WORKING_SET_KEY))
    metal = getattr(mx, "metal", None)
    for space, prefix in ((mx, "mx"), (metal, "mx.metal")):
        if space is None:
            continue
        for limit in LIMITS:
            name = f"set_{limit}_limit"
            _replace(space, name, lambda real, limit=limit, f=f"{prefix}.{name}": _capped(state, limit, f, real))
        _replace(space, "device_info", lambda real: _reporting(state, real))
    _STATE = state
    return state


def uninstall() -> None:
    """Put back what ``install`` replaced (tests; a rank keeps its wrappers to the end)."""
    global _STATE
    while _ORIGINALS:
        namespace, name, real = _ORIGINALS.pop()
        setattr(namespace, name, real)
    _STATE = None


def current() -> MemoryShare | None:
    """The installed share, or None."""
    return _STATE
