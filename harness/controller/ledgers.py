"""The desync finder: when a run fails or stops making progress, the ranks' collective ledgers
(``harness.rank.ledger``) are compared and the first collective at which they differ is named
(issued by some ranks only, or another op, shape, dtype or group size at the same sequence
number), with each side's call site and the ranks behind it. Where the ledgers agree, it says so
and names the collective every rank issued last: the one they are waiting in. Point-to-point
calls (``send``, ``recv``, ``recv_like``) match each other: one rank sends what another receives.
An executable under the rank protocol may keep its own ledger in the same file, of versioned
records (``harness/protocol/collective.schema.json``); a line of another version, or one that
breaks the schema, ends that rank's ledger there, and the comparison says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness import schema

P2P = {"send": "p2p", "recv": "p2p", "recv_like": "p2p"}


def read_ledger(path: Path) -> list[dict[str, Any]] | None:
    """A rank's ledger (None: it kept none); a torn last line (killed mid-write) is left out, and
    it ends before a line that is not a collective record (``check_ledger`` says which)."""
    checked = check_ledger(path)
    return None if checked is None else checked[0]


def check_ledger(path: Path) -> tuple[list[dict[str, Any]], str | None] | None:
    """A rank's ledger up to its first line that is not a record (None: it kept none), and why
    that line is not one (None: every line is). A Python rank's lines carry no ``protocol``; an
    executable's must be records of ``schema.COMMAND_PROTOCOL``. A last line not ended by a
    newline that is not JSON was torn by a kill mid-write: it is left out without a word."""
    if not path.exists():
        return None
    text = path.read_text(errors="replace")
    out: list[dict[str, Any]] = []
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            torn = n == len(lines) and not text.endswith("\n")
            return out, None if torn else f"line {n} is not JSON"
        if not isinstance(e, dict):
            return out, f"line {n} is not a JSON object"
        if "protocol" in e:  # an executable's record, versioned
            why = schema.protocol_problem("collective", e)
            if why is not None:
                return out, f"line {n} is not a protocol-{schema.COMMAND_PROTOCOL} collective record ({why})"
        elif not isinstance(e.get("op"), str):
            return out, f"line {n} names no op"
        out.append(e)
    return out, None


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
    """The finder's verdict on a run's ledgers (None where fewer than two ranks kept one); a
    ledger cut short by a line that is not a record is compared up to it, and its line says so
    (in ``problems`` too)."""
    found: dict[int, list[dict[str, Any]]] = {}
    problems: list[str] = []
    for r in range(world_size):
        checked = check_ledger(schema.ledger_path(run_dir, r))
        if checked is not None:
            found[r] = checked[0]
            if checked[1] is not None:
                problems.append(f"rank {r}'s ledger {checked[1]}: it is compared up to that line")
    verdict = compare(found)
    if verdict is not None and problems:
        verdict = {**verdict, "problems": problems, "line": verdict["line"] + "; " + "; ".join(problems)}
    return verdict
