"""The desync finder: after every run of more than one rank, whether it passed, failed or stalled,
the ranks' collective ledgers (``harness.rank.ledger``) are compared and the first collective at
which they differ is named (issued by some ranks only, or another op, shape, dtype or group size at
the same sequence number), with each side's call site and the ranks behind it. Where the ledgers
agree, it says how many calls it compared and, for a run that stalled, names the collective every
rank issued last: the one they are waiting in. A rank that ended on its own before the run did (it
raised, exited or was killed, not by the watchdog) is compared up to the last step it completed,
and one that ended as a consequence (its peer lost, stopped after another rank's end) up to its
last record; each is named where its ledger is shorter than the others'. A rank that finished had
issued every call it would, so a call it lacks is a divergence (a collective issued after it
finished). What this cannot see: a mismatched call in the very step a rank raised in.
Point-to-point calls (``send``, ``recv``, ``recv_like``) match each other: one rank sends what
another receives. An executable under the rank protocol may keep its own ledger in the same file,
of versioned records (``harness/protocol/collective.schema.json``); a line of another version, or
one that breaks the schema, ends that rank's ledger there, and the comparison says so.
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
            return _applied(out), None if torn else f"line {n} is not JSON"
        if not isinstance(e, dict):
            return _applied(out), f"line {n} is not a JSON object"
        if "protocol" in e:  # an executable's record, versioned
            why = schema.protocol_problem("collective", e)
            if why is not None:
                return _applied(out), f"line {n} is not a protocol-{schema.COMMAND_PROTOCOL} collective record ({why})"
        elif not isinstance(e.get("op"), str):
            return _applied(out), f"line {n} names no op"
        out.append(e)
    return _applied(out), None


def _applied(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A ledger with its retracted calls left out (``harness.rank.ledger.Ledger.on_event``)."""
    gone = {seq for e in entries if e["op"] == "retract" for seq in e.get("retracts") or ()}
    if not gone and all(e["op"] != "retract" for e in entries):
        return entries
    return [e for e in entries if e["op"] != "retract" and e.get("seq") not in gone]


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


def _lost_line(ledgers: dict[int, list[dict[str, Any]]], lost: dict[int, str]) -> str:
    longest = max((len(e) for e in ledgers.values()), default=0)
    said = [f"rank {r} {why} after #{len(ledgers[r]) - 1}" if ledgers[r] else f"rank {r} {why} before any call"
            for r, why in sorted(lost.items()) if r in ledgers and len(ledgers[r]) < longest]
    return f"; compared up to the last call of a rank that ended: {'; '.join(said)}" if said else ""


def _side(rs: list[int], e: dict[str, Any] | None, ledgers: dict[int, list[dict[str, Any]]],
          finished: set[int] | frozenset[int]) -> str:
    """The ranks ``rs`` at a divergence: their call, or none (having finished: their last)."""
    if e is None and set(rs) <= set(finished):
        last = ledgers[rs[0]][-1] if ledgers[rs[0]] else None
        return f"{_ranks(rs)}: no collective (finished; its last: {describe(last)})"
    if e is None:
        return f"{_ranks(rs)}: no collective (behind: it issued none from here)"
    return f"{_ranks(rs)}: {describe(e)}"


def compare(ledgers: dict[int, list[dict[str, Any]]], lost: dict[int, str] | None = None,
            waiting: bool = True, finished: set[int] | frozenset[int] = frozenset()) -> dict[str, Any] | None:
    """The first divergence of the ranks' ledgers, or how many calls they agree on; None without
    ledgers to compare. ``lost``: ranks that ended before the run did (why, in a few words), each
    compared up to its last record (named where that is before another rank's); ``waiting``: the
    run stalled (the agreeing line names the call the ranks wait in); ``finished``: ranks that
    completed (a call they lack is said so)."""
    if len(ledgers) < 2:
        return None
    lost = lost or {}
    common = {"lost": {str(r): why for r, why in lost.items()}}
    longest = max(len(entries) for entries in ledgers.values())
    for seq in range(longest):
        at = {r: entries[seq] if seq < len(entries) else None for r, entries in sorted(ledgers.items())
              if seq < len(entries) or r not in lost}
        if len(at) < 2:
            break
        sides: dict[tuple[Any, ...] | None, list[int]] = {}
        for r, e in at.items():
            sides.setdefault(_key(e), []).append(r)
        if len(sides) > 1:
            parts = [_side(rs, at[rs[0]], ledgers, finished) for rs in sorted(sides.values())]
            behind = [r for r, e in at.items() if e is None and r not in finished]
            return {"agree": False, "seq": seq, "compared": seq, "ranks": {str(r): e for r, e in at.items()},
                    "behind": behind, **common,
                    "line": f"collectives diverge at call #{seq}: " + "; ".join(parts) + _lost_line(ledgers, lost)}
    common["compared"] = longest
    if longest == 0:
        return {"agree": True, "seq": None, "ranks": {}, **common, "line": "no rank issued a collective"}
    last = {r: entries[-1] for r, entries in sorted(ledgers.items()) if entries}
    first = last[max(last, key=lambda r: len(ledgers[r]))]
    where = (f"; the last, #{longest - 1} {describe(first)}, is where the ranks wait" if waiting else "")
    return {"agree": True, "seq": longest - 1, "ranks": {str(r): e for r, e in last.items()}, **common,
            "line": f"collectives agree on every rank ({longest} calls){where}" + _lost_line(ledgers, lost)}


def desync(run_dir: Path, world_size: int, lost: dict[int, str] | None = None, waiting: bool = True,
           finished: set[int] | frozenset[int] = frozenset(), cut: dict[int, int] | None = None
           ) -> dict[str, Any] | None:
    """The finder's verdict on a run's ledgers (``compare``'s arguments; None for one rank); a
    ledger cut short by a line that is not a record is compared up to it, and its line says so
    (in ``problems`` too). ``cut``: ranks that ended on their own, with the last step each
    completed: their calls of the step they ended in are left out (a failing rank's collectives
    there are its failure's, not its training's). Ranks that kept no ledger are listed in
    ``missing``; with fewer than two ledgers nothing is compared (``agree`` None)."""
    if world_size < 2:
        return None
    found: dict[int, list[dict[str, Any]]] = {}
    problems: list[str] = []
    for r in range(world_size):
        checked = check_ledger(schema.ledger_path(run_dir, r))
        if checked is not None:
            found[r] = checked[0]
            if checked[1] is not None:
                problems.append(f"rank {r}'s ledger {checked[1]}: it is compared up to that line")
    last = {str(r): entries[-1] for r, entries in found.items() if entries}  # before any cut
    for r, step in (cut or {}).items():
        if r in found:
            found[r] = [e for e in found[r] if int(e.get("step") or 0) <= step]
    missing = [r for r in range(world_size) if r not in found]
    verdict = compare(found, lost, waiting, finished)
    if verdict is None:
        kept = f"only rank {next(iter(found))} kept a ledger" if found else "no rank kept a ledger"
        return {"agree": None, "seq": None, "ranks": {}, "missing": missing, "compared": 0, "line": kept,
                "last": last}
    verdict = {**verdict, "last": last}
    if missing:
        verdict = {**verdict, "missing": missing}
    if problems:
        verdict = {**verdict, "problems": problems, "line": verdict["line"] + "; " + "; ".join(problems)}
    return verdict
