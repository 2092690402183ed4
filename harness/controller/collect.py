"""Collect what each rank left behind and decide, rank by rank, whether the run succeeded.

mlx.launch exits 0 even when ranks fail, so its status is never used. A run succeeds only when
every rank wrote a result with status "ok", exited 0, and the watchdog did not stop it.
"""

from __future__ import annotations

import signal
from pathlib import Path

from harness import schema
from harness.controller.launch import launcher_exits
from harness.controller.outcome import RankOutcome, WatchReport
from harness.schema import after_step

TAIL_LINES = 12


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def collect(run_dir: Path, world_size: int, report: WatchReport) -> list[RankOutcome]:
    exits = launcher_exits(run_dir, report.remote) if world_size > 1 else {}
    ranks = []
    for r in range(world_size):
        if world_size == 1:
            code, killed = report.returncode, False
            if report.limit:
                code, killed = None, True
        else:
            code = exits.get(r)  # None: not logged (killed with the launcher) or killed by it
            killed = r in exits and code is None
        result = None
        rp = schema.result_path(run_dir, r)
        if rp.exists():
            try:
                result = schema.check_rank_result(schema.read_json(rp), str(rp))
            except schema.SchemaError as e:
                result = {"status": "error", "error": str(e)}
        try:
            events = list(schema.read_events(schema.events_path(run_dir, r)))
        except schema.SchemaError:
            events = []
        ranks.append(RankOutcome(r, code, killed, result, events, _tail(schema.stderr_path(run_dir, r))))
    return ranks


PEER_LOST = "connection to a peer was lost"
PEER_FAILED = "a peer rank failed"


STALLS = ("no_progress", "wall")  # watchdog limits that stop a run whose ranks were all there


def ended_early(o: RankOutcome, report: WatchReport) -> tuple[str, bool] | None:
    """Why a rank ended before its run did, in a few words, and whether on its own (it raised,
    exited or was killed by a fault: the step it was in is cut short) or as a consequence (its peer
    was lost, mlx.launch or the watchdog stopped it after another rank's end or over its memory);
    None where it finished, or the watchdog stopped a stalled run where it stood. Its ledger may
    end before its peers' (``harness.controller.ledgers``)."""
    if o.ok:
        return None
    stopped = o.killed or (o.result is None and report.limit and o.rank not in report.exited_early)
    if stopped:  # alive when the watchdog stopped the run
        return None if report.limit in STALLS else ("was stopped by the watchdog", False)
    if o.result is not None and o.result.get("status") != "ok":
        error = str(o.result.get("error", ""))
        peer = PEER_LOST in error or error.startswith(PEER_FAILED)
        return ("lost its peer", False) if peer else ("failed", True)
    if o.exit_code == -15:
        return "was stopped by mlx.launch", False
    if o.exit_code not in (0, None):
        return f"ended with {describe_exit(o.exit_code)}", True
    return ("exited without a result", True) if o.result is None else None


def failure_reason(ranks: list[RankOutcome], report: WatchReport) -> str | None:
    """One message per failing rank, the causes first and their consequences after.

    A rank that lost its peer, or that mlx.launch stopped with SIGTERM because another rank
    failed, is a consequence; the rank that raised, exited or died first is the cause. A rank
    gone without a result whose exit was not seen (mlx.launch stopped it for another rank's
    failure before its exit code was recorded, or a host's rank) comes between the two.
    """
    cause, unseen, consequence = 0, 1, 2
    found: list[tuple[int, int, str]] = []  # (cause, unseen or consequence; rank; message)
    for o in ranks:
        tail = f"; stderr tail:\n{o.stderr_tail}" if o.stderr_tail else ""
        if o.result is not None and o.result.get("status") != "ok":
            error = str(o.result.get("error", "unknown error"))
            peer = PEER_LOST in error or error.startswith(PEER_FAILED)
            if error.startswith(f"rank {o.rank} failed"):
                msg = error
            else:
                msg = f"rank {o.rank}: {error}" if peer else f"rank {o.rank} failed: {error}"
            found.append((consequence if peer else cause, o.rank, msg))
        elif o.exit_code not in (0, None):
            sigterm = o.exit_code == -15
            why = " (mlx.launch stops the other ranks when one fails)" if sigterm else ""
            detail = why if sigterm else f" {after_step(o.last_step)}{tail}"
            found.append((consequence if sigterm else cause, o.rank,
                          f"rank {o.rank} ended with {describe_exit(o.exit_code)}{detail}"))
        elif o.result is None and (o.rank in report.exited_early or (not o.killed and not report.limit)):
            how = "" if o.exit_code is None else f" with {describe_exit(o.exit_code)}"
            found.append((unseen if o.exit_code is None else cause, o.rank,
                          f"rank {o.rank} exited{how} without writing a result, {after_step(o.last_step)}{tail}"))
        elif not o.ok:
            found.append((consequence, o.rank, f"rank {o.rank} was stopped before it finished"))
    reasons = [msg for _, _, msg in sorted(found)]
    if report.limit:
        stacks = " (rank stacks dumped to their stderr)" if report.stacks_dumped else ""
        line = f"watchdog: {report.limit_detail}; process group killed{stacks}"
        # After a rank failed, the watchdog's kill is a consequence; a time limit is the cause.
        after = report.limit in ("peer_failed", "rank_gone") and reasons
        reasons.insert(len(reasons) if after else 0, line)
    if report.survivors:
        reasons.append(f"processes survived the kill: {report.survivors}")
    return "\n".join(reasons) if reasons else None
