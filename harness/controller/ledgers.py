"""The desync finder: when a run fails or stops making progress, the ranks' collective ledgers
(``harness.rank.ledger``) are compared and the first collective at which they differ is named
(issued by some ranks only, or another op, shape, dtype or group size at the same sequence
number), with each side's call site and the ranks behind it. Where the ledgers agree, it says so
and names the collective every rank issued last: the one they are waiting in. Point-to-point
calls (``send``, ``recv``, ``recv_like``) match each other: one rank sends what another receives.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness import schema

P2P = {"send": "p2p", "recv": "p2p", "recv_like": "p2p"}


def read_ledger(path: Path) -> list[dict[str, Any]] | None:
    """A rank's ledger (None: it kept none); a torn last line (killed mid-write) is left out."""
    if not path.exists():
        return None
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def describe(e: dict[str, Any] | None) -> str:
    if e is None:
        return "no collective"
    shape = "[" + ",".join(str(n) for n in e.get("shape") or []) + "]" if e.get("shape") is not None else ""
    peer = f" peer {e['peer']}" if e.get("peer") is not None else ""
    stream = f" on {e['stream']}" if e.get("stream") else ""
    compiled = f"compiled {e['compiled']}, " if e.get("compiled") else ""
    return f"{e['op']} {e.get('dtype') or ''}{shape}{peer}{stream} at {e.get('site')} ({compiled}step {e.get('step')})"


def _key(e: dict[str, Any] | None) -> tuple[Any, ...] | None:
    if e is None:
        return None
    return P2P.get(e["op"], e["op"]), tuple(e.get("shape") or ()), e.get("dtype"), e.get("group")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def compare(ledgers: dict[int, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """The first divergence of the ranks' ledgers, or where they all stand when they agree;
    None without ledgers to compare."""
    if len(ledgers) < 2:
        return None
    longest = max(len(entries) for entries in ledgers.values())
    for seq in range(longest):
        at = {r: entries[seq] if seq < len(entries) else None for r, entries in sorted(ledgers.items())}
        sides: dict[tuple[Any, ...] | None, list[int]] = {}
        for r, e in at.items():
            sides.setdefault(_key(e), []).append(r)
        if len(sides) > 1:
            parts = [f"{_ranks(rs)}: {describe(at[rs[0]])}" for rs in sorted(sides.values())]
            return {"agree": False, "seq": seq, "ranks": {str(r): e for r, e in at.items()},
                    "line": f"collectives diverge at call #{seq}: " + "; ".join(parts)}
    if longest == 0:
        return {"agree": True, "seq": None, "ranks": {}, "line": "no rank issued a collective"}
    last = {r: entries[-1] for r, entries in sorted(ledgers.items())}
    first = next(iter(last.values()))
    return {"agree": True, "seq": longest - 1, "ranks": {str(r): e for r, e in last.items()},
            "line": f"collectives agree on every rank ({longest} calls); the last, #{longest - 1} "
                    f"{describe(first)}, is where the ranks wait"}


def desync(run_dir: Path, world_size: int) -> dict[str, Any] | None:
    """The finder's verdict on a run's ledgers (None where fewer than two ranks kept one)."""
    found = {r: entries for r in range(world_size)
             if (entries := read_ledger(schema.ledger_path(run_dir, r))) is not None}
    return compare(found)
