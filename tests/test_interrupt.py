"""An interrupted run (Ctrl-C, a cancelled CI job's SIGTERM) keeps what its ranks wrote under
``--out``, marked interrupted, and leaves no process and no temporary directory behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, write_scenario
from tests.test_launch import gone

HANG = '\n[[faults]]\nrank = 1\nstep = 3\naction = "hang"\nruns = ["ddp2"]\n'


@pytest.mark.ranks
@pytest.mark.parametrize(("sig", "code", "why"), [(signal.SIGINT, 130, "Ctrl-C"),
                                                  (signal.SIGTERM, 128 + signal.SIGTERM, "signal SIGTERM")],
                         ids=["ctrl-c", "sigterm"])
def test_an_interrupted_run_keeps_its_partial_logs_marked_and_leaves_nothing(tmp_path: Path, sig: int, code: int,
                                                                             why: str) -> None:
    path = write_scenario(tmp_path, "stopped", (2,), steps=20, extra=HANG)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "o"
    # A terminal's Ctrl-C: the controller starts with SIGINT at its default, whatever this process
    # inherited (a suite started as a background job of a shell without job control ignores SIGINT,
    # and an ignored signal stays ignored across exec: Python then never raises KeyboardInterrupt).
    p = subprocess.Popen([sys.executable, "-m", "harness", "run", str(path), "--out", str(out), "--progress", "off"],
                         cwd=REPO, env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    # Beside other tests the run may first queue for this machine's rank slots (minutes at worst).
    deadline = time.monotonic() + 480
    events = None
    while time.monotonic() < deadline and events is None and p.poll() is None:  # rank 0 is past step 2:
        events = next((f for f in tmp.glob("mlx-ddp-harness-run-*/rank0.events.jsonl")  # rank 1 hangs in 3
                       if '"step": 2' in f.read_text()), None)
        time.sleep(0.2)
    if events is None:
        p.terminate()  # the harness stops its ranks on SIGTERM
        pytest.fail(f"the run never reached step 2: {p.communicate(timeout=60)[1][-2000:]}")
    run_dir = events.parent
    ranks = [q.pid for q in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(q.info["cmdline"] or [])]
    # and the ranks by the pid they announced (a warm-started rank's command line is its server's)
    ranks += [e["pid"] for r in (0, 1) for line in (run_dir / f"rank{r}.events.jsonl").read_text().splitlines()
              if (e := json.loads(line))["kind"] == "start"]
    p.send_signal(sig)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # where the controller stalled: its signal masks and stacks (SIGUSR1)
        try:  # whether the signal was ignored, blocked or still pending (SIGINT is 0x2, SIGTERM 0x4000)
            status = Path(f"/proc/{p.pid}/status").read_text().splitlines()
            masks = "; ".join(ln.replace("\t", " ") for ln in status if ln.startswith(("Sig", "Shd")))
        except OSError:
            masks = "no /proc status"
        p.send_signal(signal.SIGUSR1)
        time.sleep(2)
        p.kill()
        pytest.fail(f"the harness had not exited 60 s after {why} ({masks}): {p.communicate()[1][-6000:]}")
    assert p.returncode == code, err
    kept = out / "runs" / "stopped" / "ddp2"
    marker = (kept / "INTERRUPTED").read_text()
    assert marker.startswith(f"run 'ddp2' was interrupted ({why})"), marker
    assert '"step": 2' in (kept / "rank0.events.jsonl").read_text()
    assert {"rank0.stdout", "rank0.stderr", "rank1.stdout", "rank1.stderr", "rank1.events.jsonl"} <= \
        {f.name for f in kept.iterdir()}
    assert not run_dir.exists() and not list(tmp.glob("mlx-ddp-harness-*"))  # no temporary directory left
    assert ranks and not [pid for pid in ranks if not gone(pid)]


def _text(path: Path) -> str:
    """A file's text, or nothing where its run has just removed it."""
    try:
        return path.read_text()
    except OSError:
        return ""


def _training(tmp: Path) -> dict[str, list[int]]:
    """The runs in ``tmp`` past their step 2, each with its rank 0's pid, read at once: a run that ends
    between the look and the read (its directory removed) is left out, to be looked for again."""
    found = {}
    for f in tmp.glob("mlx-ddp-harness-run-*/rank0.events.jsonl"):
        try:
            if '"step": 2' in _text(f):
                events = [json.loads(line) for line in f.read_text().splitlines()]
                found[json.loads((f.parent / "job.json").read_text())["run"]] = [
                    e["pid"] for e in events if e["kind"] == "start"]
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.ranks
def test_ctrl_c_while_floor_runs_go_side_by_side_stops_them_all(tmp_path: Path) -> None:
    """A scenario's floor runs (here ``single``'s twin of 2 ranks and its rerun) go side by side on the
    CPU; a Ctrl-C in their midst stops every one of them, each kept and marked, nothing left."""
    again = '\n[[runs]]\nname = "again"\nworld_size = 1\ncompare_to = "single"\n'  # judged against a rerun
    path = write_scenario(tmp_path, "floors", (1, 2), steps=40, extra=again)
    # rank slots of its own: beside other tests' launches the second floor run could wait for one
    slots = {"MLX_DDP_HARNESS_RANK_DIR": str(tmp_path / "slots"), "MLX_DDP_HARNESS_RANK_BUDGET": "4"}
    deadline = time.monotonic() + 480
    for attempt in range(3):  # on a loaded machine one floor run's 40 steps may end before the other's start
        tmp, out = tmp_path / f"tmp{attempt}", tmp_path / f"o{attempt}"
        tmp.mkdir()
        p = subprocess.Popen([sys.executable, "-m", "harness", "run", str(path), "--out", str(out), "--progress",
                              "off"], cwd=REPO, env={**os.environ, "TMPDIR": str(tmp), **slots},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        training: dict[str, list[int]] = {}  # run -> its rank 0's pids
        while time.monotonic() < deadline and len(training) < 2 and p.poll() is None:  # two runs train at once
            training = _training(tmp)
            time.sleep(0.05)
        if len(training) == 2:
            break
        p.terminate()
        ended = p.communicate(timeout=60)
        assert p.returncode == 0, ended  # the run itself went well: only the moment was missed
    else:
        pytest.fail(f"no two runs trained at once in 3 runs: {ended}")
    names = set(training)
    ranks = [pid for pids in training.values() for pid in pids]
    sent = time.time()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert names == {"twin2", "single_rerun"}, names  # the floor runs, not declared ones
    marked = []
    for name in names:
        kept = out / "runs" / "floors" / name
        if (kept / "INTERRUPTED").exists():
            marker = (kept / "INTERRUPTED").read_text()
            assert marker.startswith(f"run {name!r} was interrupted (Ctrl-C)"), marker
            marked.append(name)
        else:  # it ended between the look above and the Ctrl-C (a loaded machine): kept whole, as a run that ended
            assert json.loads((kept / "rank0.result.json").read_text())["status"] == "ok", name
            ends = [e["time"] for line in (kept / "rank0.events.jsonl").read_text().splitlines()
                    if (e := json.loads(line))["kind"] == "end"]
            # by the time the Ctrl-C took effect: the controller's handler, then each run's watchdog at its
            # next poll (a run ended 0.22 s after the signal on a loaded machine); a Ctrl-C that no run
            # heeded would leave none marked (below)
            assert ends and ends[0] < sent + 1.0, (name, ends, sent)
    assert marked, names
    assert not list(tmp.glob("mlx-ddp-harness-*"))  # no run directory, no workspace left
    assert ranks and not [pid for pid in ranks if not gone(pid)]
