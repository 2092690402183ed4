"""A benchmark's repeats kept in a file as each one finishes, so that one comparison can be carried
over several invocations (a lent GPU's calls of a few minutes each, say) and judged over all of them.

The file is JSON Lines: a first line naming the benchmark and its *plan* (everything that must be
the same for repeats to be pooled: the device, the model, the steps, the sides, the repeats before
the first look and the most; ``repeat_ratios.looks``), then one line per finished repeat with where
and when it ran and what it measured. A repeat is appended whole (flushed to disk) before the next
starts, so an invocation stopped mid-repeat loses only that repeat (a line cut short is dropped).
Continuing a record with another plan is refused in one line naming the option that differs: the
looks and their level are the plan's, so its stated 95 % holds over every invocation together.
Each repeat's ratios are paired within it (its sides ran back to back on one machine), so repeats
from different machines with the plan's device pool.
"""

from __future__ import annotations

import argparse
import calendar
import hashlib
import json
import os
import select
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VERSION = 1
INVOKED = time.monotonic()  # about when this invocation began: a time limit counts from here


class RecordError(SystemExit):
    """A record that cannot be continued: its one-line reason."""


HERE = Path(__file__).resolve().parent


def _commit() -> str | None:
    """This tree's commit (``+dirty`` with changes to tracked files), where it is a git checkout."""
    from harness.controller.environment import git_revision

    return git_revision(HERE)


def _is_code(path: str) -> bool:
    """What a benchmark runs: the package, the examples and the benchmarks' own modules (not records)."""
    return path.startswith(("harness/", "examples/")) or (
        path.startswith("benchmarks/") and path.count("/") == 1 and path.endswith(".py"))


def _fingerprint(blobs: dict[str, str]) -> str:
    text = "".join(f"{p} {b}\n" for p, b in sorted(blobs.items()) if _is_code(p))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def code_of(root: Path) -> str | None:
    """A fingerprint of the code in the checkout at ``root`` as its files are now (``_is_code``; git
    blob ids, so equal to a commit's exactly when the files are that commit's, untracked new ones
    included): a copy whose ``.git`` lags behind its files still names the commit it runs. None
    outside git."""
    from harness.controller.environment import git_output

    top = git_output(root, "rev-parse", "--show-toplevel")
    listed = git_output(Path(top), "ls-files", "-co", "--exclude-standard") if top else None
    if listed is None:
        return None
    paths = [p for p in dict.fromkeys(listed.splitlines()) if _is_code(p) and (Path(top) / p).is_file()]
    blobs = git_output(Path(top), "hash-object", "--stdin-paths", stdin="\n".join(paths)) if paths else ""
    if blobs is None:
        return None
    return _fingerprint(dict(zip(paths, blobs.splitlines(), strict=True)))


def commit_of_code(root: Path, base: str, code: str) -> str | None:
    """The first commit after ``base`` (a short commit) in the checkout at ``root`` whose code is ``code``."""
    from harness.controller.environment import git_output

    for commit in (git_output(root, "rev-list", "--reverse", "--abbrev-commit", f"{base}..HEAD") or "").split():
        listed = git_output(root, "ls-tree", "-r", "--full-tree", commit) or ""
        blobs = {line.partition("\t")[2]: line.split()[2] for line in listed.splitlines() if "\t" in line}
        if _fingerprint(blobs) == code:
            return commit
    return None


def device_name() -> str:
    """What the ranks compute on here (``cuda: NVIDIA H200``), part of a plan: repeats pool on one kind."""
    from harness.controller.devices import accelerators

    acc = accelerators()
    return f"{acc.kind}: {acc.name}"


def planned_device(args: argparse.Namespace) -> str | None:
    """The plan's device: this machine's (``device_name``); none where ``--report-only`` reports a
    record (its own is read from it, and this machine's is not asked)."""
    return None if args.report_only else device_name()


def _read(path: Path, write: bool = True) -> list[str]:
    """The record's lines; a last line cut short (a write stopped part way) is dropped, saying so, and
    from the file where ``write``."""
    try:
        text = path.read_bytes().decode()
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(f"{path}: cannot read it as a repeat record ({e.__class__.__name__}: {e})") from None
    if text and not text.endswith("\n"):
        kept = text[:text.rfind("\n") + 1]
        if write:
            with open(path, "r+b") as f:
                f.truncate(len(kept.encode()))
        print(f"{path}: its last line was cut short (a repeat stopped while it was written): dropped"
              f"{'' if write else ' from this report'}", file=sys.stderr)
        text = kept
    return text.splitlines()


def _entries(path: Path, lines: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The record's head and its repeats, each checked for the fields a reader takes from it."""
    try:
        head, body = json.loads(lines[0]), [json.loads(line) for line in lines[1:] if line.strip()]
    except (json.JSONDecodeError, IndexError) as e:
        raise RecordError(f"{path}: not a repeat record ({e})") from None
    if not isinstance(head, dict) or not isinstance(head.get("plan"), dict):
        raise RecordError(f"{path}: not a repeat record (its first line names no plan)")
    for n, r in enumerate(body, 2):
        if not isinstance(r, dict) or not {"where", "at", "data"} <= set(r):
            raise RecordError(f"{path}: line {n} is not a repeat (where, at and data)")
    return head, body


@dataclass
class RepeatRecord:
    """The repeats of one plan so far, and where new ones go (``path``; None: kept in memory only).
    The plan's keys name the options that set them (``--steps``), which a refusal names."""

    benchmark: str
    plan: dict[str, Any]
    path: Path | None = None
    repeats: list[dict[str, Any]] = field(default_factory=list)
    where: str = ""
    commit: str | None = None  # of the code this invocation runs, taken when it opens the record
    code: str | None = None  # its code's fingerprint (``code_of``)
    _mark: float = field(default_factory=time.monotonic)  # when this invocation's last repeat ended (or began)

    @classmethod
    def open(cls, path: Path | None, benchmark: str, plan: dict[str, Any], where: str = "",
             report_only: bool = False) -> RepeatRecord:
        """The record at ``path`` (a new one where it does not exist), checked to hold ``plan``; with
        ``report_only`` (``--report-only``), one with repeats, read and never written, whose device
        may be another than this one's (``plan``'s is not read)."""
        rec = cls(benchmark, json.loads(json.dumps(plan)), path, [], where or socket.gethostname(), _commit(),
                  None if report_only else code_of(HERE))
        if path is not None and path.is_dir():
            raise RecordError(f"{path}: a folder; --record takes a file")
        if report_only and (path is None or not path.is_file() or path.stat().st_size == 0):
            raise RecordError(f"--report-only reports a record: {path or '--record FILE'} is not one")
        if path is None or not path.exists() or path.stat().st_size == 0:
            if path is not None:
                if not path.parent.is_dir():
                    raise RecordError(f"{path}: its folder {path.parent} does not exist")
                rec._write({"record": benchmark, "version": VERSION, "plan": rec.plan})
            return rec
        head, body = _entries(path, _read(path, write=not report_only))
        if head.get("record") != benchmark or head.get("version") != VERSION:
            raise RecordError(f"{path}: a record of {head.get('record')!r} version {head.get('version')}, "
                              f"not of {benchmark!r} version {VERSION}")
        was = head["plan"]
        differ = [k for k in sorted(set(was) | set(rec.plan)) if was.get(k) != rec.plan.get(k)
                  and not (report_only and k == "device")]
        if differ:
            k = differ[0]
            def said(v: Any) -> str:
                return "not given" if v is None else repr(v)

            raise RecordError(f"{path}: its repeats were run with {k} {said(was.get(k))}, this invocation has "
                              f"{said(rec.plan.get(k))}; continue it with the same options, or start a new record")
        rec.repeats = body
        if report_only:
            if not body:
                raise RecordError(f"{path}: no repeats yet: nothing to report")
            rec.plan["device"] = was.get("device")
        return rec

    def add(self, data: dict[str, Any]) -> None:
        """One finished repeat's figures, written at once."""
        now = time.monotonic()
        entry = {"repeat": len(self.repeats) + 1, "where": self.where, "commit": self.commit, "code": self.code,
                 "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(now - self._mark, 1),
                 "data": data}
        self._mark = now
        self.repeats.append(entry)
        if self.path is not None:
            self._write(entry)

    def _write(self, line: dict[str, Any]) -> None:
        data = (json.dumps(line) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def data(self) -> list[dict[str, Any]]:
        return [r["data"] for r in self.repeats]

    def seconds_per_repeat(self, keep: Callable[[dict[str, Any]], bool] = lambda data: True) -> float | None:
        """The median seconds a repeat took (of those whose data ``keep`` keeps): as recorded, or
        for repeats recorded without them, the gaps between consecutive repeats' finishing times
        (the gaps between invocations are a few and the median passes them over). None without
        two repeats to go by."""
        kept = [r for r in self.repeats if keep(r["data"])]
        recorded = [r["seconds"] for r in kept if "seconds" in r]
        if recorded:
            return statistics.median(recorded)
        stamps = [calendar.timegm(time.strptime(r["at"], "%Y-%m-%dT%H:%M:%SZ")) for r in kept]
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > a]
        return statistics.median(gaps) if gaps else None

    def provenance(self, root: Path | None = None) -> str:
        """Where and when the repeats ran, e.g. ``12 repeats: 8 on gpu-a (ab12cd3), 4 on gpu-b (ab12cd3)``;
        a commit with ``+dirty`` whose code is that of a later commit of ``root``'s checkout names it
        too (``9cc3ea4+dirty: the code of a017734``)."""
        if not self.repeats:
            return "no repeats"
        groups: dict[tuple[str, str | None], int] = {}
        found: dict[tuple[str, str], str | None] = {}
        for r in self.repeats:
            c, code = r.get("commit"), r.get("code")
            if c and c.endswith("+dirty") and code:
                if (c, code) not in found:
                    found[(c, code)] = commit_of_code(root or HERE, c.removesuffix("+dirty"), code)
                c += f": the code of {found[(c, code)]}" if found[(c, code)] else ""
            groups[(r["where"], c)] = groups.get((r["where"], c), 0) + 1
        parts = ", ".join(f"{n} on {w}" + (f" ({c})" if c else "") for (w, c), n in groups.items())
        return f"{len(self.repeats)} repeats, {self.repeats[0]['at']} to {self.repeats[-1]['at']}: {parts}"


@dataclass
class TimeLimit:
    """Start no repeat that would not end within ``seconds`` of the invocation's start (``INVOKED``),
    judged by the longest repeat so far (a machine lent for calls of a few minutes: the record is
    continued by the next call, nothing killed mid-repeat). The first repeat always starts; None: no
    limit."""

    seconds: float | None
    report_only: bool = False  # ``--report-only``: no repeat starts
    started: float = INVOKED
    longest: float = 0.0
    _mark: float | None = None

    def room(self) -> bool:
        """Whether another repeat fits; called before each one (it times the one before)."""
        if self.report_only:
            return False
        now = time.monotonic()
        if self._mark is not None:
            self.longest = max(self.longest, now - self._mark)
        self._mark = now
        return self.seconds is None or self.longest == 0.0 or now + self.longest <= self.started + self.seconds

    def stopped(self, record: RepeatRecord, done: int, most: int) -> None:
        """Say on stderr that the invocation stops here, at ``done`` of a run's ``most`` repeats, and how it goes on."""
        if self.report_only:
            print(f"{done} of at most {most} repeats in {record.path} reported; the same command without --report-only "
                  f"continues it", file=sys.stderr, flush=True)
            return
        print(f"stopped at the time limit ({self.seconds:g} s; the longest repeat took {self.longest:.0f} s): "
              f"{done} of at most {most} repeats in {record.path}, continued by the same command",
              file=sys.stderr, flush=True)


def quiet_pipe(main: Callable[[], None]) -> None:
    """``main()``, where a reader of the report that went away (``| head``) ends it quietly: every
    repeat is in the record by then."""
    try:
        main()
    except BrokenPipeError:
        if not _reader_gone():  # a pipe of the benchmark's own work: an error
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit


def _reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (``poll`` says so: ``POLLERR`` on Linux,
    ``POLLHUP`` on some other systems; a pipe's writing end gets neither while it is read)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or no file behind stdout
        return False


def add_options(parser: argparse.ArgumentParser) -> None:
    """``--record FILE``, ``--time-limit SECONDS``, ``--look-every K`` and ``--report-only``, as every
    benchmark with repeats takes them."""
    parser.add_argument("--record", type=Path, metavar="FILE",
                        help="keep each repeat in FILE as it finishes, and continue the repeats already there (same "
                             "options), judging them all together (repeat_record)")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="with --record: start no repeat that would end past SECONDS from now (judged by the "
                             "longest so far); the same command continues")
    parser.add_argument("--look-every", type=int, metavar="K",
                        help="look at the intervals every K repeats from the first look on, not after each rotation "
                             "of the sides: fewer looks, each one's interval narrower (part of the plan)")
    parser.add_argument("--report-only", action="store_true",
                        help="with --record: report the repeats in FILE and run none, on any machine (the other "
                             "options as the record's)")


def check_options(args: argparse.Namespace) -> None:
    if args.look_every is not None and args.look_every < 1:
        raise SystemExit(f"--look-every {args.look_every}: a number of repeats, 1 or more")
    if args.time_limit is not None and not args.record:
        raise SystemExit("--time-limit stops before the plan's repeats are done: give --record FILE to keep them")


def time_limit(args: argparse.Namespace) -> TimeLimit:
    """The options' limit on starting repeats (``--time-limit``, ``--report-only``)."""
    return TimeLimit(args.time_limit, args.report_only)
