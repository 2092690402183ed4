"""Warm rank starts (``harness.controller.warm_ranks``, ``harness.rank.warm``): ranks forked from
a server that has done their imports compute, fail, stop and are counted as cold ranks are.
Real ranks; the client is started here as mlx.launch would start it where a test needs its pid."""

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

from harness import schema
from harness.controller import ring_yield, warm_ranks
from harness.controller.launch import _rank_env
from harness.controller.rank_processes import alive
from harness.controller.run_job import execute
from harness.controller.warm_ranks import WARM_VAR, rank_argv, stop_servers
from harness.scenario import FaultSpec
from harness.scenario.job import AllSumJob

pytestmark = pytest.mark.ranks


@pytest.fixture(autouse=True)
def _stop_servers(tmp_path: Path):  # noqa: ANN202
    yield
    if (tmp_path / "warm").is_dir():
        stop_servers(tmp_path / "warm")


def wait_for(what, timeout: float = 60.0):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s")


def job_dir(tmp_path: Path, job: AllSumJob) -> Path:
    run_dir = tmp_path / "run"
    (run_dir / "tmp").mkdir(parents=True)
    schema.write_json_atomic(run_dir / schema.JOB_FILE,
                             schema.stamp(job.launched(world_size=1, launched_at=time.time()).to_json()))
    return run_dir


def start_pid(run_dir: Path) -> int | None:
    try:
        lines = schema.events_path(run_dir, 0).read_text().splitlines()
    except FileNotFoundError:
        return None
    return next((e["pid"] for line in lines if (e := json.loads(line))["kind"] == "start"), None)


def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rounds: int = 200) -> tuple[subprocess.Popen, Path, int]:
    """A warm client of a 1-rank all-sum job that runs ``rounds`` rounds 0.05 s apart, once its
    server is up; with the rank's pid."""
    monkeypatch.setenv(WARM_VAR, str(tmp_path / "warm"))
    run_dir = job_dir(tmp_path, AllSumJob(value=2.0, rounds=rounds, pause_s=0.05))
    env = _rank_env(run_dir)
    argv = rank_argv(run_dir, env)
    assert argv is not None and argv[-1].endswith(".sock")
    wait_for(lambda: Path(argv[-1]).exists())
    with open(run_dir / "rank0.stderr", "wb") as err:
        proc = subprocess.Popen([sys.executable, *argv, str(run_dir)], env=env, cwd=run_dir, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    pid = wait_for(lambda: start_pid(run_dir))
    return proc, run_dir, pid


def test_warm_ranks_sum_alike_are_not_the_launchers_children_and_their_cpu_is_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WARM_VAR, str(tmp_path / "warm"))
    job = AllSumJob(value=3.0, rounds=4, pause_s=0.05)
    for ws in (1, 2):
        execute("first", job, ws)  # starts the server (these launches may run cold while it imports)
    wait_for(lambda: len(list((tmp_path / "warm").glob("*.sock"))) == 1)  # ring ranks yielding or not: one
    for ws in (1, 2):
        out = execute(f"warm{ws}", job, ws, keep_to=tmp_path / f"ws{ws}")
        assert out.ok, out.failure
        for r in range(ws):
            assert out.result(r)["sums"] == [ws * 3.0 * s + sum(range(ws)) for s in range(1, 5)]
        used = [json.loads(schema.warm_rusage_path(tmp_path / f"ws{ws}", r).read_text())["cpu_s"] for r in range(ws)]
        assert all(u > 0 for u in used) and out.watch.cpu.own_s >= sum(used), (used, out.watch.cpu)
        assert out.watch.survivors == [] and not any(alive(p) for p in out.watch.rank_pids.values())
    monkeypatch.delenv(WARM_VAR)
    cold = execute("cold", job, 1, keep_to=tmp_path / "cold")
    assert cold.ok and not schema.warm_rusage_path(tmp_path / "cold", 0).exists()


def test_what_libraries_set_on_import_does_not_split_servers_and_what_changes_an_import_does() -> None:
    job = {"kind": "train", "trainer": {"module": "harness.trainers.reference.rank"},
           "scenario": {"model": {"arch": "qwen3"}}}
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/src", "LD_PRELOAD": "/lib/libopenblas.so.0"}
    after_imports = {**base, "HF_XET_HIGH_PERFORMANCE": "0", "TOKENIZERS_PARALLELISM": "false",
                     "TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    key = warm_ranks.key_of(job, base)[0]
    assert warm_ranks.key_of(job, after_imports)[0] == key
    for changed in ({"MLX_DISABLE_COMPILE": "1"}, {"PYTHONPATH": "/other"}, {"LD_PRELOAD": ""}, {"HF_HOME": "/h"},
                    {"HF_XET_CACHE": "/x"}):
        assert warm_ranks.key_of(job, {**base, **changed})[0] != key, changed
    assert warm_ranks.key_of(job, base)[1]["harness"] == warm_ranks.harness_code()


def test_a_change_to_the_harnesss_sources_is_another_server(tmp_path: Path) -> None:
    (tmp_path / "rank").mkdir()
    (source := tmp_path / "rank" / "entry.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("not source\n")
    before = warm_ranks.harness_code(tmp_path)
    warm_ranks.harness_code.cache_clear()
    (tmp_path / "notes.txt").write_text("still not source\n")
    assert warm_ranks.harness_code(tmp_path) == before
    warm_ranks.harness_code.cache_clear()
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 1_000_000))
    assert warm_ranks.harness_code(tmp_path) != before  # edited: the same size, a later time


MOMENTS = """
import fcntl, os, sys, time
while True:  # a launch's question whether a server holds the lock, asked without pause
    fd = os.open(sys.argv[1], os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        time.sleep(0.001)
    except BlockingIOError:
        pass
    os.close(fd)
    time.sleep(0.002)
"""


def test_a_server_starts_while_launches_ask_whether_one_holds_its_lock(tmp_path: Path) -> None:
    """A launch asks by taking the lock for a moment (``warm_ranks._held``); a server starting in
    such a moment once gave up, and the launch, finding the lock free, ran cold."""
    for attempt in range(6):
        directory = tmp_path / f"warm{attempt}"
        directory.mkdir()
        run_dir = job_dir(tmp_path / f"try{attempt}", AllSumJob(value=1.0, rounds=1))
        env = _rank_env(run_dir)
        key, what = warm_ranks.key_of(json.loads((run_dir / schema.JOB_FILE).read_text()), env)
        lock = schema.warm_server_path(directory, key, "lock")
        lock.touch()
        asking = subprocess.Popen([sys.executable, "-c", MOMENTS, str(lock)])
        try:
            time.sleep(0.2)
            warm_ranks._start_server(directory, key, run_dir / schema.JOB_FILE, env, what)
            pid = int(lock.read_text() or 0)  # the server's, written before the start returned
        finally:
            asking.kill()
            asking.wait()
        try:
            log = schema.warm_server_path(directory, key, "log").read_text()
            assert warm_ranks._serving(directory, key) and pid and alive(pid), (attempt, pid, log)
        finally:
            stop_servers(directory)


def test_killing_a_warm_client_kills_its_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc, _, pid = client(tmp_path, monkeypatch)
    assert psutil.Process(pid).ppid() != proc.pid  # forked by the server, not started by the client
    proc.kill()
    proc.wait(timeout=10)
    wait_for(lambda: not alive(pid), timeout=5)


def _signal_state(pid: int) -> str:
    """Each thread's pending, blocked and caught signals (Linux), for a failure's message."""
    out = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            fields = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        out.append(f"{task.name} {fields.get('Name', '?').strip()}: " + " ".join(
            f"{k} {fields.get(k, '?').strip()}" for k in ("SigPnd", "ShdPnd", "SigBlk", "SigCgt")))
    return "; ".join(out) or "none"


def test_a_signal_reaches_the_rank_and_the_client_ends_as_the_rank_did(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    proc, run_dir, pid = client(tmp_path, monkeypatch)
    proc.send_signal(signal.SIGUSR1)  # the watchdog's stack dump
    try:
        wait_for(lambda: "most recent call first" in (run_dir / "rank0.stderr").read_text(), timeout=10)
    except AssertionError as e:  # what the rank and its client were doing then
        raise AssertionError(f"{e}: client exit {proc.poll()}, rank alive {alive(pid)}, rank stderr "
                             f"{(run_dir / 'rank0.stderr').read_text()[-2000:]!r}, signal state: client "
                             f"{_signal_state(proc.pid)}; rank {_signal_state(pid)}") from None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert not alive(pid)


def test_a_rank_that_ends_returns_its_exit_code_through_the_client(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    proc, run_dir, _ = client(tmp_path, monkeypatch, rounds=2)
    assert proc.wait(timeout=60) == 0
    assert json.loads(schema.result_path(run_dir, 0).read_text())["sums"] == [2.0, 4.0]
    monkeypatch.setenv(WARM_VAR, str(tmp_path / "warm"))
    failing = execute("failing", AllSumJob(rounds=3, faults=(FaultSpec(rank=0, step=2, action="exit", code=3),)), 1)
    assert not failing.ok and failing.failure.startswith("rank 0 ended with exit code 3"), failing.failure


def test_a_client_without_a_server_starts_the_rank_itself(tmp_path: Path) -> None:
    run_dir = job_dir(tmp_path, AllSumJob(value=1.0, rounds=2))
    client_py = Path(__file__).resolve().parents[1] / "harness" / "rank" / "warm_client.py"
    p = subprocess.run([sys.executable, "-I", "-S", str(client_py), str(tmp_path / "none.sock"), str(run_dir)],
                       env=_rank_env(run_dir), cwd=run_dir, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    assert json.loads(schema.result_path(run_dir, 0).read_text())["sums"] == [1.0, 2.0]
    assert not schema.warm_rusage_path(run_dir, 0).exists()


def test_a_warm_run_says_so_and_reports_only_its_own_libraries(tmp_path: Path) -> None:
    from harness.present.tables import WARM_NOTE
    from tests.conftest import cli, write_scenario

    path = write_scenario(tmp_path, "warm", world_sizes=(1, 2), steps=2)
    warm = cli("run", str(path), "--out", str(tmp_path / "warm_out"),
               env={WARM_VAR: str(tmp_path / "warm"), ring_yield.VAR: "on"})  # ddp2's ranks yield
    assert warm.returncode == 0, warm.stdout[-3000:] + warm.stderr[-2000:]
    assert f"run ddp2: {WARM_NOTE}" in warm.stdout
    (s,) = json.loads((tmp_path / "warm_out" / "result.json").read_text())["scenarios"]
    assert all(r["warm_start"] for r in s["runs"]), [(r["name"], r["warm_start"]) for r in s["runs"]]
    assert all(r["startup"]["libraries_loaded"] == ["mlx_lm"] for r in s["runs"])  # the reference's: no transformers
    if ring_yield.library() is not None:  # one server for the one-process runs and the yielding ring run
        assert len(list((tmp_path / "warm").glob("*.key.json"))) == 1
        yielding = {r["name"]: [any(n.startswith("ring_yield-") for n in rk["preloaded"]) for rk in r["ranks"]]
                    for r in s["runs"]}
        assert yielding == {"single": [False], "ddp2": [True, True], **{n: [False] for n in yielding
                                                                         if n not in ("single", "ddp2")}}, yielding
    cold = cli("run", str(path), "--out", str(tmp_path / "cold_out"), env={WARM_VAR: ""})
    assert cold.returncode == 0 and WARM_NOTE not in cold.stdout


PRELOADED = """
import json, os, sys
from pathlib import Path
from harness import schema
from harness.rank import entry, warm
from harness.scenario import load_scenario
from harness.scenario.plan import job_for

job = job_for(load_scenario(Path(sys.argv[1])), sys.argv[2])
if sys.argv[3] == "server":
    path = Path(sys.argv[4])
    schema.write_json_atomic(path, schema.stamp(job.to_json()))
    warm.preload(path)
    if os.environ.get("LD_PRELOAD"):  # the harness's BLAS, one thread: a server here serves (else none does)
        assert warm.threads() == 1, f"{warm.threads()} threads after the preload: the server would refuse"
else:
    entry.load_libraries(job)
print(json.dumps([m for m in sys.argv[5:] if m in sys.modules]))
"""


@pytest.mark.parametrize(("scenario", "later"), [("scenarios/script_example.toml", "jsonschema"),
                                                ("examples/cpp_worker/cpp_worker.toml", "jsonschema"),
                                                ("scenarios/unsloth_parity.toml", "mlx_lm.utils")])
def test_a_server_imports_what_its_trainers_ranks_import_later_and_a_cold_rank_does_not(
        tmp_path: Path, scenario: str, later: str, request: pytest.FixtureRequest) -> None:
    """A script's or an executable's rank imports jsonschema when it checks its first protocol
    record, unsloth-zoo's rank 0 mlx-lm's saving utilities at its final save: a warm-start server
    imports them beforehand (its forked ranks pay for neither), a cold rank only when it gets there."""
    from tests.conftest import REPO, needs_unsloth

    if "unsloth" in scenario:
        needs_unsloth()
    if "cpp_worker" in scenario:
        request.getfixturevalue("worker")  # the scenario names the built worker
    path = REPO / scenario
    found = {}
    (tmp_path / "tmp").mkdir()
    for side in ("server", "cold"):  # in a rank's environment, as a server starts
        p = subprocess.run([sys.executable, "-c", PRELOADED, str(path), "single", side, str(tmp_path / "job.json"),
                            later], capture_output=True, text=True, timeout=120, cwd=REPO, env=_rank_env(tmp_path))
        assert p.returncode == 0, p.stderr[-2000:]
        found[side] = json.loads(p.stdout.strip().splitlines()[-1])
    assert found == {"server": [later], "cold": []}
