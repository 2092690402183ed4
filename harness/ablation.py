"""What a rank of the harness does that a bare process does not, each switchable off for
``benchmarks/observer_effect.py`` alone (``--ablate``), so that what the harness costs the trainer it
measures can be traced to a part.

``VAR`` (``MLX_DDP_HARNESS_ABLATE``) names the parts turned off, comma-separated, in the
controller's environment, which its ranks inherit. ``run``, ``gate``, ``soak``, ``doctor`` and the
pytest plugin refuse to start with it set (``refuse``): a part turned off can blind a check (the sampler feeds the
memory ceilings, the ledger names a hang's collective), so no verdict is ever given without it.
A rank records what was off in its result (``ablated``). ``sampler/K`` (or ``ledger/K``) instead
runs the memory sampler (the ledger's recording) in alternate blocks of K steps (``alternating``;
``benchmarks/alternating_part.py``), recorded as ``alternated``.
"""

from __future__ import annotations

import os

VAR = "MLX_DDP_HARNESS_ABLATE"

# each part and what turning it off leaves out
PARTS: dict[str, str] = {
    "env": "the variables the launcher sets (TMPDIR to the run's directory, PYTHONUNBUFFERED, "
           "OPENBLAS_NUM_THREADS)",
    "preload": "the libraries preloaded into the rank (LD_PRELOAD: OpenBLAS on a Linux CPU)",
    "faulthandler": "faulthandler and its stack dump on SIGUSR1",
    "device_check": "the check that the device computes right, before training",
    "memory_share": "the memory limits capped at the rank's share (MLX's limit functions and device_info wrapped)",
    "warm_up": "the device's warm-up (a matmul; on Metal also a compiled gradient in the model's dtype)",
    "libraries": "the trainer's libraries imported before training (load_libraries; what it hides stays hidden)",
    "sampler": "the memory sampler's thread (sampling every 20 ms; the per-step figures are still read)",
    "ledger": "the ledger's interposition on MLX's collectives",
    "start": "the digest of the parameters training starts from and the copy rank 0 keeps of them (both read "
             "every parameter to the host before the first step)",
    "cache_clear": "MLX's cache cleared after each of the harness's host reads of parameters (on CUDA; "
                   "harness.rank.host_read)",
}


class AblationError(ValueError):
    """``VAR`` names a part that does not exist."""


ALTERNATING = ("sampler", "ledger")  # the parts that can also run in alternate blocks of steps (``part/K``)


def _names(environ: dict[str, str] | None) -> frozenset[str]:
    value = (os.environ if environ is None else environ).get(VAR, "")
    return frozenset(p.strip() for p in value.split(",") if p.strip())


def ablated(environ: dict[str, str] | None = None, strict: bool = False) -> frozenset[str]:
    """The parts turned off; ``strict``: ``AblationError`` for a name that is no part (else such a
    name turns nothing off: the benchmark checks its ``--ablate`` strictly before it sets ``VAR``).
    ``part/K`` is not off: it alternates (``alternating``)."""
    names = _names(environ)
    plain = frozenset(n for n in names if "/" not in n)
    unknown = sorted(plain - PARTS.keys())
    if unknown and strict:
        raise AblationError(f"{VAR}: no part named {', '.join(unknown)} (parts: {', '.join(PARTS)})")
    if strict:
        alternating(environ, strict=True)
    return plain & PARTS.keys()


def alternating(environ: dict[str, str] | None = None, strict: bool = False) -> dict[str, int]:
    """The parts named ``part/K``: each runs in the first K steps, not in the next K, and so on,
    so that one run times its steps with the part and without it (``benchmarks/alternating_part.py``)."""
    found: dict[str, int] = {}
    for name in _names(environ):
        if "/" not in name:
            continue
        part, _, block = name.partition("/")
        if part in ALTERNATING and block.isdigit() and int(block) >= 1:
            found[part] = int(block)
        elif strict:
            raise AblationError(f"{VAR}: {name!r}: the parts that alternate are {' and '.join(ALTERNATING)}, as "
                                f"part/K with K >= 1 steps")
    return found


def on(part: str) -> bool:
    """Whether ``part`` (a key of ``PARTS``) runs in this process."""
    return part not in ablated()


def refuse(command: str) -> str | None:
    """Why ``command`` must not run in this environment (``VAR`` set), or None."""
    if os.environ.get(VAR):
        return (f"{VAR} is set ({os.environ[VAR]}): it turns parts of every rank off for "
                f"benchmarks/observer_effect.py alone, and {command} gives no verdict without them; unset it")
    return None
