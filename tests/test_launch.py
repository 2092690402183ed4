"""The controller against real ranks: isolation of concurrent launches, failures, watchdog, cleanup.

Every test here starts real rank processes (plain Python for world size 1, mlx.launch otherwise).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import psutil
import pytest

from harness.controller.launch import write_hostfile
from harness.controller.run_job import execute
from harness.controller.watch import GONE_GRACE_S, LAUNCH_END_GRACE_S, gone_stops_the_run
from harness.scenario import FaultSpec
from harness.scenario.job import AllSumJob

pytestmark = pytest.mark.ranks


def probe(value: float, world_size: int, *, rounds: int = 4, faults: list[dict] | None = None,
          keep: Path | None = None, wall_s: float = 120, no_progress_s: float = 60, pause_s: float = 0.05):
    job = AllSumJob(value=value, rounds=rounds, faults=tuple(FaultSpec(**f) for f in faults or ()), pause_s=pause_s)
    return execute(f"probe{value}", job, world_size, wall_s=wall_s, no_progress_s=no_progress_s, keep_to=keep)


def expected_sums(value: float, world_size: int, rounds: int) -> list[float]:
    return [world_size * value * s + sum(range(world_size)) for s in range(1, rounds + 1)]


def assert_clean(outcome) -> None:  # noqa: ANN001
    """No process of the run survives, and its run directory is gone."""
    assert outcome.watch.survivors == []
    for pid in outcome.watch.rank_pids.values():
        assert gone(pid), pid


def gone(pid: int) -> bool:
    """No such process, or only its zombie; one that ends between the two questions is gone."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_world_size_one_is_a_plain_process_without_mlx_env(tmp_path: Path) -> None:
    out = probe(3.0, 1, keep=tmp_path)
    assert out.ok, out.failure
    res = out.result(0)
    assert res["sums"] == expected_sums(3.0, 1, 4)
    assert res["mlx_env"] == [] and res["world_size"] == 1 and res["backend"] == "none"
    assert "launcher.log" not in os.listdir(tmp_path)
    assert "rank 0 round 4" in (tmp_path / "rank0.stdout").read_text()
    assert_clean(out)


_JOB = """
import json, sys
from harness.controller.run_job import execute
from harness.scenario.job import AllSumJob
v, ws, rounds = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
o = execute("c", AllSumJob(value=v, rounds=rounds, pause_s=0.1), ws, wall_s=240, no_progress_s=120)
print(json.dumps({"ok": o.ok, "failure": o.failure, "sums": [r.result and r.result.get("sums") for r in o.ranks]}))
"""


def test_concurrent_launches_never_share_ports() -> None:
    """Four 2-rank jobs started at once from four controller processes each get their own sums."""
    rounds = 6
    values = [11.0, 23.0, 37.0, 51.0]
    procs = [subprocess.Popen([sys.executable, "-c", _JOB, str(v), "2", str(rounds)], stdout=subprocess.PIPE,
                              text=True) for v in values]
    for v, p in zip(values, procs, strict=True):
        out, _ = p.communicate(timeout=300)
        got = json.loads(out.strip().splitlines()[-1])
        assert got["ok"], got["failure"]
        want = expected_sums(v, 2, rounds)
        assert got["sums"] == [want, want], f"job {v} got another job's sums: {got['sums']}"


def test_two_and_four_ranks_sum_and_capture_output_per_rank(tmp_path: Path) -> None:
    for ws in (2, 4):
        keep = tmp_path / f"ws{ws}"
        out = probe(5.0, ws, keep=keep)
        assert out.ok, out.failure
        assert [o.result["sums"] for o in out.ranks] == [expected_sums(5.0, ws, 4)] * ws
        assert {o.result["backend"] for o in out.ranks} == {"ring"}
        for r in range(ws):
            assert f"rank {r} round 4" in (keep / f"rank{r}.stdout").read_text()
        assert_clean(out)


def test_the_launcher_does_not_spin_while_its_ranks_wait() -> None:
    """Ranks that sleep 3 x 0.7 s between all-sums: the run (controller, launcher, ranks) uses a
    fraction of one core. mlx.launch's own loop used more than a core for as long as its ranks ran."""
    out = probe(1.0, 2, rounds=3, pause_s=0.7)
    assert out.ok, out.failure
    cpu = out.watch.cpu
    assert cpu is not None and cpu.wall_s > 2.1 and cpu.own_s < 0.5 * cpu.wall_s, cpu


def test_the_launcher_log_names_every_rank_exit(tmp_path: Path) -> None:
    """mlx.launch logs a rank's exit 0 only when verbose; the wrapper logs it always, and the
    controller reads every status from the log."""
    from harness.controller.calm_launch import logging_exits
    from harness.controller.launch import LAUNCHER_LOG, launcher_exits

    seen = []
    log = logging_exits(lambda verbose, *args, **kw: seen.append((verbose, args)))
    log(False, "Node with rank 1 completed")
    log(False, "Running", "cmd")
    assert seen == [(True, ("Node with rank 1 completed",)), (False, ("Running", "cmd"))]
    (tmp_path / LAUNCHER_LOG).write_text("\x1b[32m[INFO] Node with rank 1 completed \x1b[0m\n"
                                         "[WARN] Node with rank 0 exited with code -9\n"
                                         "[WARN] Node with rank 2 was killed\n"
                                         "[WARN] Node with rank 3 exited with code 4\n")
    assert launcher_exits(tmp_path) == {1: 0, 0: -9, 2: None, 3: 4}
    assert launcher_exits(tmp_path / "none") == {}


def test_quiet_select_watches_only_output_pipes() -> None:
    from harness.controller.calm_launch import WAIT_S, quiet_select

    r, w = os.pipe()
    try:
        assert quiet_select([r], [w], [], 1.0) == ([], [], [])  # nothing to read; a writable pipe is not news
        os.write(w, b"x")
        assert quiet_select([r], [w], [], None) == ([r], [], [])
        t0 = time.monotonic()
        assert quiet_select([0], [w], [], 5.0) == ([], [], [])
        assert time.monotonic() - t0 < 1.0 and WAIT_S <= 0.05
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("pidfd", [True, False])
def test_the_watchdogs_wait_ends_when_the_launch_ends_not_at_its_next_poll(pidfd: bool) -> None:
    from harness.controller.watch import ExitWait

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    ended = ExitWait(proc)
    try:
        if pidfd and ended.fd is None:
            pytest.skip("no pidfd here (macOS, an old kernel or a sandbox): the other case is the one that runs")
        if not pidfd and ended.fd is not None:  # as where the system has no pidfd: Popen.wait
            ended.close()
        t0 = time.monotonic()
        ended.sleep(0.3)  # the process lives: the whole wait
        assert time.monotonic() - t0 >= 0.29 and proc.poll() is None
        proc.stdin.close()  # the process ends
        t0 = time.monotonic()
        ended.sleep(30.0)
        assert time.monotonic() - t0 < 10.0 and proc.wait(timeout=5) == 0
    finally:
        ended.close()
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    ("action", "expect"),
    [
        ("raise", "rank 1 failed: RuntimeError: injected fault at step 2"),
        ("exit", "rank 1 ended with exit code 3"),
        ("sigkill", "rank 1 ended with signal SIGKILL"),
        ("segfault", "rank 1 ended with signal SIGSEGV"),
        ("exit0", "rank 1 exited with exit code 0 without writing a result, after step 1"),
    ],
)
def test_a_failing_rank_fails_the_run_with_rank_and_cause(action: str, expect: str) -> None:
    out = probe(1.0, 2, faults=[{"rank": 1, "step": 2, "action": action, "code": 3}])
    assert not out.ok
    assert out.failure.splitlines()[0].startswith(expect), out.failure
    assert_clean(out)


def test_hang_is_caught_by_no_progress_limit_with_stacks(tmp_path: Path) -> None:
    out = probe(1.0, 2, rounds=50, faults=[{"rank": 1, "step": 3, "action": "hang", "code": 0}],
                keep=tmp_path, no_progress_s=5)
    assert not out.ok
    assert out.watch.limit == "no_progress" and out.watch.stacks_dumped
    assert out.failure.startswith("watchdog: no progress from any rank for 5 s")
    stderr = (tmp_path / "rank1.stderr").read_text()
    assert "most recent call first" in stderr and "inject" in stderr
    assert_clean(out)


def test_wall_clock_limit_kills_single_process() -> None:
    out = probe(1.0, 1, rounds=50, faults=[{"rank": 0, "step": 2, "action": "hang", "code": 0}],
                wall_s=3, no_progress_s=60)
    assert not out.ok and out.watch.limit == "wall"
    assert "wall-clock limit of 3 s exceeded" in out.failure
    assert_clean(out)


def test_no_temp_files_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run dirs, hostfiles and mlx.launch's pidfiles all live under TMPDIR and are removed."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    ok = probe(2.0, 2)
    bad = probe(2.0, 2, faults=[{"rank": 0, "step": 2, "action": "sigkill", "code": 0}])
    assert ok.ok and not bad.ok
    assert [p for p in tmp_path.iterdir() if p.name != "mlx"] == []


def test_hostfile_is_private(tmp_path: Path) -> None:
    path = write_hostfile(tmp_path, 3, "ring")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = json.loads(path.read_text())
    assert data["backend"] == "ring" and len(data["hosts"]) == 3
    assert all(h == {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]} for h in data["hosts"])


def test_a_rank_whose_end_was_not_seen_is_named_after_the_rank_that_failed() -> None:
    """Rank 1 exited with code 3; mlx.launch stopped rank 0 for it before its exit code was
    recorded: rank 0 gone without a result and without an exit code is the consequence."""
    from harness.controller.collect import failure_reason
    from harness.controller.outcome import RankOutcome, WatchReport

    step = [{"kind": "step", "step": 1}]
    report = WatchReport(wall_s=3.0, returncode=3, limit="rank_gone", limit_detail="ranks 0, 1 gone without a result",
                         exited_early=[0, 1])
    ranks = [RankOutcome(0, None, False, None, step, "[ring] Socket 4 was closed by the peer"),
             RankOutcome(1, 3, False, None, step, "")]
    lines = failure_reason(ranks, report).splitlines()
    assert lines[0] == "rank 1 ended with exit code 3 after step 1"
    assert lines[1].startswith("rank 0 exited without writing a result, after step 1")
    lost = RankOutcome(1, None, False, {"status": "error", "error": "connection to a peer was lost"}, step, "")
    alone = failure_reason([lost, ranks[0]], report).splitlines()
    assert alone[0].startswith("rank 0 exited without writing a result")  # no seen failure: before its peer
    assert "rank 1: connection to a peer was lost" in alone[1:]


def yield_library() -> ModuleType:
    """``harness.controller.ring_yield``, where its library builds (Linux, a C compiler); else skip."""
    from harness.controller import ring_yield

    if not sys.platform.startswith("linux") or ring_yield.library() is None:
        pytest.skip("the ring yield library is built on Linux with a C compiler")
    return ring_yield


@pytest.mark.parametrize("mode", ["on", "off"])
def test_ring_ranks_that_yield_while_waiting_sum_alike_and_the_run_says_so(mode: str, monkeypatch) -> None:  # noqa: ANN001
    """4 ring ranks with the yielding library preloaded (``on``; ``auto`` does so where they fill
    the cores) sum exactly as without it, and the run carries the note; ``off`` carries none."""
    ring_yield = yield_library()
    monkeypatch.setenv(ring_yield.VAR, mode)
    out = probe(3.0, 4, rounds=6, pause_s=0.0)
    assert out.ok, out.failure
    assert [o.result["sums"] for o in out.ranks] == [expected_sums(3.0, 4, 6)] * 4
    loaded = [any(n.startswith("ring_yield-") for n in o.result["preloaded"]) for o in out.ranks]
    if mode == "on":
        assert out.ring_yield and out.ring_yield.startswith("its ranks yield a core while they wait on a peer"), out
        assert loaded == [True] * 4  # every rank has it mapped
    else:
        assert out.ring_yield is None and loaded == [False] * 4
    assert_clean(out)


def test_the_ring_yield_library_waits_only_where_switched_on() -> None:
    """Preloaded, a non-blocking recv that finds nothing gives its core away (a yield, then naps
    of up to 200 us), unless the process's environment switches it off (a rank forked from a warm
    server that preloads it for every rank): then every call passes straight through."""
    ring_yield = yield_library()
    code = ("import resource, socket\n"
            "a, b = socket.socketpair()\n"
            "a.setblocking(False)\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw\n"
            "for _ in range(2000):\n"
            "    try:\n        a.recv(4)\n    except BlockingIOError:\n        pass\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before)\n")

    def naps(active: str | None) -> int:
        """The loop's voluntary context switches: a nap gives the core away, and a busy machine's
        preemptions (involuntary) do not count, so the figure does not depend on the load."""
        env = {k: v for k, v in os.environ.items() if k != ring_yield.ACTIVE_VAR}
        env["LD_PRELOAD"] = str(ring_yield.library())
        if active is not None:
            env[ring_yield.ACTIVE_VAR] = active
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        return int(p.stdout)

    on, switched_on, off = naps(None), naps("1"), naps("0")
    assert min(on, switched_on) > 1000, (on, switched_on)  # 2000 empty polls, all but the first 50 us napping
    assert off < 20, (on, switched_on, off)


def test_the_ring_yield_library_passes_every_result_and_error_through(tmp_path: Path) -> None:
    """Preloaded, a non-blocking recv with nothing to read still fails with EAGAIN; sent bytes arrive
    unchanged; and the library is mapped into the process."""
    ring_yield = yield_library()
    code = ("import socket\n"
            "a, b = socket.socketpair()\n"
            "a.setblocking(False)\n"
            "try:\n    a.recv(4)\n    print('no error')\nexcept BlockingIOError:\n    print('eagain')\n"
            "b.send(b'abcd')\n"
            "print(a.recv(4).decode())\n"
            "print('ring_yield' in open('/proc/self/maps').read())\n")
    env = {**os.environ, "LD_PRELOAD": str(ring_yield.library())}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["eagain", "abcd", "True"]


def test_ranks_gone_without_a_result_stop_the_run_only_where_a_peer_may_wait_for_them() -> None:
    # a peer still runs: one that exited 0 stops the run at once, others after the grace
    assert gone_stops_the_run({1}, 10.0, 10.0, exited_0=True, all_ended=False)
    assert not gone_stops_the_run({1}, 10.0, 10.0 + GONE_GRACE_S / 2, exited_0=False, all_ended=False)
    assert gone_stops_the_run({1}, 10.0, 10.0 + GONE_GRACE_S, exited_0=False, all_ended=False)
    # every rank ended (a rank died and mlx.launch stopped the other): nothing waits, mlx.launch is let exit
    assert not gone_stops_the_run({0, 1}, 10.0, 10.0 + 2 * GONE_GRACE_S, exited_0=False, all_ended=True)
    assert not gone_stops_the_run({1}, 10.0, 10.0 + GONE_GRACE_S, exited_0=True, all_ended=True)
    assert gone_stops_the_run({0, 1}, 10.0, 10.0 + LAUNCH_END_GRACE_S, exited_0=False, all_ended=True)
    assert not gone_stops_the_run(set(), 10.0, 100.0, exited_0=False, all_ended=True)
