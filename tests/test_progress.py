"""Progress while runs run: the feed read from rank event files, a live display in a real
pseudo-terminal, and plain periodic lines when the output is piped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import schema
from harness.controller.progress import ProgressFeed, RankProgress, RunProgress
from harness.present.live import PlainProgress
from tests.conftest import EXAMPLE, REPO, script_scenario

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _event(f, **e) -> None:  # noqa: ANN001
    f.write(json.dumps({"schema_version": schema.SCHEMA_VERSION, **e}) + "\n")


def test_the_feed_reads_what_each_rank_wrote_since_the_last_poll(tmp_path: Path) -> None:
    seen: list[str] = []
    feed = ProgressFeed(RunProgress("s", "ddp2", 2, 10), lambda p: seen.append(p.describe()))
    feed.start(tmp_path)
    assert seen[-1].startswith("s/ddp2 (2 ranks): step 0/10 [starting]")
    with open(schema.events_path(tmp_path, 0), "w") as r0, open(schema.events_path(tmp_path, 1), "w") as r1:
        _event(r0, kind="phase", name="train")
        for step in (1, 2, 3):
            _event(r0, kind="step", step=step, step_time_s=0.5, tokens_global=100)
        _event(r1, kind="step", step=1, step_time_s=0.5, tokens_global=100)
        r1.write('{"kind": "step", "st')  # a line not yet complete is left for the next poll
    feed.poll(True)
    p = feed.progress
    assert (p.ranks[0].step, p.ranks[1].step, p.step) == (3, 1, 1)  # the run is where its slowest rank is
    assert p.tok_s == pytest.approx(200.0) and p.eta_s == pytest.approx(0.5 * 9)
    assert "step 1/10 [r0 3, r1 1], 200 tok/s, ETA 4s" in seen[-1]
    with open(schema.events_path(tmp_path, 1), "a") as r1:
        r1.write(f'ep": 3, "schema_version": {schema.SCHEMA_VERSION}}}\n')
    feed.poll(True)
    assert p.ranks[1].step == 3 and p.step == 3
    feed.finish("ok")
    assert seen[-1].startswith("s/ddp2 (2 ranks): done (ok)")


def test_plain_lines_come_once_a_run_trains_then_every_period() -> None:
    lines: list[str] = []
    show = PlainProgress(lines.append, every_s=3600)
    p = RunProgress("s", "single", 1, 4, state="running")
    show(p)
    assert lines == []  # nothing to say before the first step
    p.ranks[0] = RankProgress("train", 1)
    show(p)
    show(p)  # within the period: no second line
    assert len(lines) == 1 and "s/single (1 rank): step 1/4" in lines[0]
    show.every_s = 0
    show(p)
    assert len(lines) == 2


def slow_script_scenario(tmp_path: Path, name: str) -> Path:
    """A 2-rank run of the example script that waits 0.25 s per step (6 steps): the run outlasts
    several display periods on any machine, however fast its steps."""
    src = EXAMPLE.read_text().replace("import mlx.core as mx", "import time\n\nimport mlx.core as mx", 1)
    src = src.replace("        run.step(step,", "        time.sleep(0.25)\n        run.step(step,", 1)
    assert src.count("time.sleep(0.25)") == 1
    return script_scenario(tmp_path, src, name=name, world_sizes=(2,))


@pytest.mark.ranks
def test_a_run_shows_live_progress_in_a_terminal(tmp_path: Path) -> None:
    """In a real pseudo-terminal: rich's display redraws in place (cursor codes) and shows each
    running run's steps of its total, its ranks, tokens/s."""
    pexpect = pytest.importorskip("pexpect")
    path = slow_script_scenario(tmp_path, "live")
    child = pexpect.spawn(sys.executable, ["-m", "harness", "run", str(path)], cwd=str(REPO), timeout=300,
                          env={**os.environ, "COLUMNS": "160", "TERM": "xterm"}, dimensions=(40, 160),
                          encoding="utf-8", codec_errors="replace")
    child.expect(r"live/ddp2 \(2\)")  # the 2-rank run's bar ...
    child.expect(r"\d/6")             # ... its steps of the total ...
    child.expect(r"r0:\d+ r1:\d+")     # ... where each rank is
    child.expect(pexpect.EOF)
    out = child.before
    child.close()
    assert child.exitstatus == 0, out[-3000:]
    assert "tok/s" in out and ANSI.search(out), out[-3000:]
    assert "live: PASSED" in ANSI.sub("", out)


@pytest.mark.ranks
def test_piped_output_gets_plain_progress_lines(tmp_path: Path) -> None:
    """Piped output: plain lines (no cursor codes), the first once the run trains, then one per
    period."""
    path = slow_script_scenario(tmp_path, "piped")
    p = subprocess.run([sys.executable, "-m", "harness", "run", str(path), "--progress-every", "0.3"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert not ANSI.search(p.stderr) and not ANSI.search(p.stdout)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("  progress piped/ddp2 (2 ranks): step ")]
    steps = [int(re.search(r"step (\d+)/6", ln).group(1)) for ln in lines]
    assert len(steps) >= 2 and steps == sorted(steps) and steps[0] >= 1, p.stderr
    assert all(re.search(r"\[r0 \S+, r1 \S+\]", ln) for ln in lines), lines
