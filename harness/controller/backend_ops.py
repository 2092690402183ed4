"""Which collectives a distributed backend implements, taken from MLX itself: a probe launch of 2
ranks tries each (``harness.rank.collective_probe``) once per MLX version and backend, and the
table is cached beside the harness's other inputs. A scenario's trainer states what it needs
beyond ``all_sum`` (``[trainer] collectives``); a run whose backend lacks one is refused before
anything starts (``harness.controller.preflight``), and a rank that raises in one anyway is named
with the collective, its call site and the backend's lack (``lack_named``)."""

from __future__ import annotations

import functools
import json
from importlib import metadata
from pathlib import Path

from harness import schema
from harness.controller.inputs import cache_dir
from harness.scenario.names import COLLECTIVE_OPS

PROBE_WALL_S = 60.0


def _cache(backend: str) -> Path:
    return cache_dir() / f"collectives-mlx{metadata.version('mlx')}-{backend}.json"


@functools.cache
def backend_ops(backend: str) -> dict[str, str | None] | str:
    """Each collective of ``COLLECTIVE_OPS`` on ``backend``: None where it works, else what MLX
    raised; or, as a string, why the backend could not be probed here."""
    path = _cache(backend)
    if path.exists():
        return json.loads(path.read_text())["ops"]
    from harness.controller.run_job import LaunchError, execute
    from harness.scenario.job import AllSumJob

    try:
        out = execute(f"collective-probe-{backend}", AllSumJob(ops=COLLECTIVE_OPS), 2, backend=backend,
                      wall_s=PROBE_WALL_S, no_progress_s=PROBE_WALL_S / 2)
    except LaunchError as e:
        return f"the probe could not start: {e}"
    if not out.ok:
        return f"the probe's ranks failed: {(out.failure or '').splitlines()[0]}"
    found = [out.result(r)["ops"] for r in range(2)]
    ops = {op: found[0].get(op) or found[1].get(op) for op in COLLECTIVE_OPS}
    path.parent.mkdir(parents=True, exist_ok=True)
    schema.write_json_atomic(path, {"mlx": metadata.version("mlx"), "backend": backend, "ops": ops})
    return ops


def lacks(backend: str, needs: list[str] | tuple[str, ...]) -> tuple[list[str], str | None]:
    """The ops of ``needs`` that ``backend`` lacks, and a note where it could not be probed."""
    if not needs:
        return [], None
    ops = backend_ops(backend)
    if isinstance(ops, str):
        return [], f"which collectives the {backend} backend implements is unknown ({ops}): not checked before launch"
    return [op for op in needs if ops.get(op) is not None], None


def lacking_line(backend: str, missing: list[str]) -> str:
    ops = backend_ops(backend)
    said = "; ".join(f"{op}: {ops[op]}" for op in missing) if isinstance(ops, dict) else ""
    return (f"the {backend} backend lacks {', '.join(missing)} (MLX {metadata.version('mlx')}, probed: {said})")


def lack_named(backend: str | None, run_dir: Path, failed: list[int]) -> str | None:
    """Where a rank of ``failed`` raised in a collective its backend lacks (the last call of its
    ledger, ``harness.rank.ledger``): that collective, its call site and the lack, in one line;
    None otherwise. A backend not probed yet is probed only where that call is not an ``all_sum``
    (which every backend has)."""
    from harness.controller.ledgers import describe, read_ledger

    if not backend:
        return None
    for r in failed:
        ledger = read_ledger(schema.ledger_path(run_dir, r)) or []
        e = ledger[-1] if ledger else None
        if e is None or e.get("op") == "all_sum" or e.get("op") not in COLLECTIVE_OPS:
            continue
        ops = backend_ops(backend)
        if isinstance(ops, dict) and ops.get(e["op"]) is not None:
            return f"rank {r}'s last collective, #{e.get('seq')} {describe(e)}: " + lacking_line(backend, [e["op"]])
    return None
