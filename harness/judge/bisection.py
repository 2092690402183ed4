"""Which commit of a range first regressed: the bisection's bookkeeping, apart from how a probe
is run (``harness.run.bisect``).

The range is GOOD's first-parent descendants up to BAD, in order: index 0 is GOOD (known to
pass), index n is BAD. BAD is probed first, to confirm it regresses against GOOD; then the
commit nearest the middle of what is still open, until the last good commit and the first bad
one are neighbours. A commit that cannot be tested (it does not install, lacks the scenario, or
writes results this harness cannot read) or whose probe could not decide is set aside, as ``git
bisect skip`` does, and the next one nearest the middle is probed instead; where only such
commits lie between the two, the answer is that range, never a guess.

Each probe's paired speed test may raise a false alarm. The bisection splits that test's
false-alarm rate evenly over the most probes it may make (``Budget``): confirming BAD, the
halvings of the range, and ``spare`` probes for commits set aside, so that the chance of naming
a commit for speed noise holds over the whole bisection; a bisection that would need more probes
stops with the range left. The other gates (a check's verdict, the losses, memory, a run that
fails) are thresholds, as in any gate: their own noise is what their tolerances allow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

BAD, GOOD, UNDECIDED, UNTESTABLE = "bad", "good", "undecided", "untestable"
OUTCOMES = (BAD, GOOD, UNDECIDED, UNTESTABLE)


@dataclass(frozen=True)
class Commit:
    sha: str
    subject: str

    @property
    def short(self) -> str:
        """A commit's first 12 hex digits; a release's version whole."""
        return self.sha[:12] if len(self.sha) == 40 else self.sha


@dataclass
class Probe:
    """One commit tested against GOOD: its outcome, the metric that decided it (the first that
    regressed; for an untestable commit, why), that metric's figure, and the runs it took."""

    index: int
    commit: Commit
    outcome: str
    metric: str = ""
    figure: str = ""
    runs: int = 0

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"a probe's outcome is one of {', '.join(OUTCOMES)}, not {self.outcome!r}")


@dataclass(frozen=True)
class Budget:
    """The most probes a bisection of ``commits`` commits after GOOD may make, and the false-alarm
    rate each may spend so that the whole bisection stays within ``alpha``."""

    commits: int
    alpha: float
    spare: int = 2

    @property
    def probes(self) -> int:
        halvings = math.ceil(math.log2(self.commits)) if self.commits > 1 else 0
        return 1 + halvings + self.spare

    @property
    def per_probe(self) -> float:
        return self.alpha / self.probes


@dataclass
class Answer:
    """Where the bisection ended: ``found`` (the first bad commit, exactly), ``range`` (the first
    bad one is among ``candidates``: the commits between the last good and the first bad that
    could not be tested or decided, and the first bad), ``none`` (BAD does not regress against
    GOOD), ``undecided`` (BAD's own probe could not decide, or the probes ran out)."""

    kind: str
    first_bad: Commit | None = None
    candidates: list[Commit] = field(default_factory=list)
    last_good: Commit | None = None
    why: str = ""


class Bisection:
    """The open range and the probes made; ``commits[0]`` is GOOD, ``commits[-1]`` BAD."""

    def __init__(self, commits: list[Commit], budget: Budget):
        if len(commits) < 2:
            raise ValueError("a bisection needs GOOD and at least one commit after it")
        self.commits = commits
        self.budget = budget
        self.good = 0
        self.bad: int | None = None  # BAD's index once its probe found it regressed
        self.set_aside: set[int] = set()
        self.probes: list[Probe] = []
        self.stopped = ""  # why it stopped early

    @property
    def last(self) -> int:
        return len(self.commits) - 1

    def next_index(self) -> int | None:
        """The next commit to probe, or None when the bisection is over."""
        if self.stopped:
            return None
        if not self.probes:
            return self.last  # BAD first
        if self.bad is None:
            return None  # BAD did not regress, or could not be decided
        open_ = [i for i in range(self.good + 1, self.bad) if i not in self.set_aside]
        if not open_:
            return None
        if len(self.probes) >= self.budget.probes:
            self.stopped = f"the {self.budget.probes} probes the false-alarm budget allows are spent"
            return None
        middle = (self.good + self.bad) / 2
        return min(open_, key=lambda i: (abs(i - middle), i))

    def record(self, probe: Probe) -> None:
        self.probes.append(probe)
        if probe.outcome == BAD:
            self.bad = probe.index
        elif probe.outcome == GOOD:
            self.good = probe.index
        else:
            self.set_aside.add(probe.index)
        if probe.index == self.last and probe.outcome == UNTESTABLE:
            self.stopped = f"BAD ({self.commits[-1].short}) cannot be tested: {probe.metric}"

    def answer(self) -> Answer:
        first = self.probes[0] if self.probes else None
        if first is None or (first.index == self.last and first.outcome in (UNDECIDED, UNTESTABLE)):
            why = self.stopped or (f"BAD's probe could not decide ({first.metric}: {first.figure})" if first else "")
            return Answer("undecided", why=why)
        if self.bad is None:
            return Answer("none", last_good=self.commits[self.good],
                          why=f"{self.commits[-1].short} does not regress against GOOD")
        between = [self.commits[i] for i in range(self.good + 1, self.bad)]
        last_good = self.commits[self.good]
        if not between:
            return Answer("found", first_bad=self.commits[self.bad], last_good=last_good)
        return Answer("range", candidates=[*between, self.commits[self.bad]], last_good=last_good,
                      why=self.stopped or "the commits between could not be tested or decided")
