"""Which collectives a distributed backend implements, taken from MLX itself: a probe launch of 2
ranks tries each (``harness.rank.collective_probe``) once per MLX version, backend and
accelerator, and the table is cached beside the harness's other inputs. A scenario's trainer
states what it needs beyond ``all_sum`` (``[trainer] collectives``); a run on this machine whose
backend lacks one is refused before anything starts (``harness.controller.preflight``; a
cluster's hosts are not probed), and a rank that raises in one anyway is named with the
collective, its call site and the backend's lack (``lack_named``, after the run)."""

from __future__ import annotations

import functools
import json
from importlib import metadata
from pathlib import Path
from typing import Any

from harness import schema
from harness.controller.inputs import cache_dir
from harness.scenario.names import COLLECTIVE_OPS

PROBE_WALL_S = 60.0
AS_PROBED = {"recv_like": "recv"}  # the ledger's op -> the probe's


def _cache(backend: str) -> Path:
    from harness.controller.devices import accelerators

    return cache_dir() / f"collectives-mlx{metadata.version('mlx')}-{accelerators().kind}-{backend}.json"


def _found(out: Any) -> dict[str, str | None]:
    """What each op did on either rank: from the results, else from the probe's events (a probe
    that hung in an exchange one side lacks still says what came before)."""
    found: dict[str, str | None] = {}
    for o in out.ranks:
        seen = (o.result or {}).get("ops") or {e["op"]: e.get("error") for e in o.events
                                                 if e.get("kind") == "collective_probe"}
        for op, error in seen.items():
            found[op] = found.get(op) or error
    return found


@functools.cache
def backend_ops(backend: str) -> dict[str, str | None] | str:
    """Each collective of ``COLLECTIVE_OPS`` on ``backend``: None where it works, else what MLX
    raised (absent: the probe could not tell); or, as a string, why the backend could not be
    probed here. Only a probe whose every op ended, each failure naming its op as MLX's "not
    supported" errors do, is cached on disk: another error may be the moment's."""
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
    ops = _found(out)
    if not ops:
        return f"the probe's ranks failed: {(out.failure or '').splitlines()[0]}"
    if out.ok and set(ops) == set(COLLECTIVE_OPS) and all(op in e for op, e in ops.items() if e):
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
    unknown = [op for op in needs if op not in ops]
    note = (f"the probe of the {backend} backend could not tell whether it has {', '.join(unknown)}"
            if unknown else None)
    return [op for op in needs if ops.get(op) is not None], note


def lacking_line(backend: str, missing: list[str]) -> str:
    ops = backend_ops(backend)
    said = "; ".join(f"{op}: {ops[op]}" for op in missing) if isinstance(ops, dict) else ""
    return f"the {backend} backend lacks {', '.join(missing)} (MLX {metadata.version('mlx')}, probed: {said})"


def lack_named(backend: str | None, ranks: list[Any], collectives: dict[str, Any] | None) -> str | None:
    """Where a rank raised in a collective its backend lacks (its last ledger record, in
    ``collectives["last"]``, naming an op its error names too): that collective, its call site and
    the lack, in one line; None otherwise. The backend is probed then if it was not yet."""
    from harness.controller.ledgers import describe

    last = (collectives or {}).get("last") or {}
    for o in ranks:
        e, error = last.get(str(o.rank)), str(((o.result or {}).get("error")) or "")
        op = AS_PROBED.get(e["op"], e["op"]) if e else None
        if not backend or op is None or op == "all_sum" or op not in COLLECTIVE_OPS or e["op"] not in error:
            continue
        ops = backend_ops(backend)
        if isinstance(ops, dict) and ops.get(op) is not None:
            return f"rank {o.rank}'s last collective, #{e.get('seq')} {describe(e)}: " + lacking_line(backend, [op])
    return None
