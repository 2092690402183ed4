"""Runs across hosts: hostfiles, placement, the host agent, and scenarios across simulated hosts
(network namespaces with an SSH server each, ``tests/simhosts.py``) with link faults."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness.cluster_spec import Cluster, ClusterError, ClusterHost, from_mapping, load_hostfile
from harness.controller import ring_yield
from harness.controller.remote import _rewrite
from tests.conftest import REPO, SharedRun, cli
from tests.simhosts import SimHosts, unavailable

TEXT_PARITY = REPO / "scenarios" / "text_parity.toml"


# -- pure logic --------------------------------------------------------------------------------

def test_placement_puts_ranks_in_blocks_over_the_hosts() -> None:
    c = Cluster([ClusterHost("a", ["1"]), ClusterHost("b", ["2"])])
    assert c.place(1) == [0]
    assert c.place(2) == [0, 1]
    assert c.place(4) == [0, 0, 1, 1]
    assert c.place(3) == [0, 0, 1]
    assert Cluster([ClusterHost("a", ["1"]), ClusterHost("b", ["2"]), ClusterHost("c", ["3"])]).place(2) == [0, 1]


def test_a_hostfile_in_mlx_launch_form_is_read_with_the_harness_settings(tmp_path: Path) -> None:
    f = tmp_path / "hosts.json"
    f.write_text(json.dumps({"backend": "ring", "envs": ["MLX_METAL_FAST_SYNCH=1"],
                             "hosts": [{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac1", "ips": ["10.0.0.1"]},
                                       {"ssh": "mac2", "ips": ["10.0.0.2"]}],
                             "harness": {"python": "/opt/venv/bin/python", "workdir": "/var/tmp"}}))
    c = load_hostfile(f)
    assert [h.ssh for h in c.hosts] == ["mac1", "mac2"]  # one entry per rank, as mlx.launch's own
    assert (c.python, c.workdir, c.envs) == ("/opt/venv/bin/python", "/var/tmp", ["MLX_METAL_FAST_SYNCH=1"])
    assert load_hostfile(f).hosts == from_mapping({"hostfile": str(f)}, "[cluster]").hosts


@pytest.mark.parametrize(("content", "expect"), [
    ("[", "not a JSON hostfile"),
    ('{"hosts": []}', "non-empty list"),
    ('[{"ips": ["1.2.3.4"]}]', 'needs "ssh"'),
    ('[{"ssh": "mac1"}]', 'needs "ips"'),
    ('{"hosts": [{"ssh": "a", "ips": ["1"]}], "harness": {"workdir": "tmp"}}', "absolute path"),
    ('{"hosts": [{"ssh": "a", "ips": ["1"]}], "harness": {"pyhton": "/x"}}', "unknown key"),
])
def test_a_bad_hostfile_is_refused_naming_the_file_and_the_problem(tmp_path: Path, content: str, expect: str) -> None:
    f = tmp_path / "hosts.json"
    f.write_text(content)
    with pytest.raises(ClusterError, match=expect) as e:
        load_hostfile(f)
    assert str(f) in str(e.value)
    r = cli("run", str(TEXT_PARITY), "--hostfile", str(f))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and expect in r.stderr, r.stderr


def test_job_paths_are_rewritten_to_the_hosts_mirror_only_at_path_boundaries() -> None:
    job = {"a": "/tmp/run-1/x", "b": ["/tmp/run-10/y", "/tmp/run-1"], "c": {"d": "/data/rows.jsonl"}, "e": 3}
    out = _rewrite(job, {"/tmp/run-1": "/w/m/tmp/run-1", "/data/rows.jsonl": "/w/m/data/rows.jsonl"})
    assert out == {"a": "/w/m/tmp/run-1/x", "b": ["/tmp/run-10/y", "/w/m/tmp/run-1"],
                   "c": {"d": "/w/m/data/rows.jsonl"}, "e": 3}


def test_an_agent_that_gives_no_answer_at_the_end_is_reported_with_what_is_known_of_why(tmp_path: Path) -> None:
    """The run's end asks each host's agent to finish; one that had ended says its exit code and last
    stderr line, one that stays silent how long it was waited for (stand-in agents: not DDP)."""
    from harness.cluster_spec import LOCAL
    from harness.controller.host_link import HostLink
    from harness.controller.remote import RemoteRanks

    ended = tmp_path / "ended-python"
    ended.write_text("#!/bin/sh\necho 'agent: cannot start here' >&2\nexit 3\n")
    silent = tmp_path / "silent-python"
    silent.write_text("#!/bin/sh\nexec sleep 3\n")  # ends soon after the finish stops waiting for it
    for f in (ended, silent):
        f.chmod(0o755)
    host = ClusterHost(LOCAL, [LOCAL])
    hosts = RemoteRanks(Cluster([host]), [0])
    hosts.links[0] = HostLink(0, host, str(ended))
    hosts.links[0].proc.wait(timeout=10)
    assert hosts.links[0].closed.wait(10)  # its stderr read to the end
    left = hosts.finish()
    assert len(left) == 1 and left[0].startswith(f"{LOCAL}:unknown (its agent did not answer: it had ended with exit "
                                                 f"code 3, "), left
    assert left[0].endswith(" s after it started (agent: cannot start here))"), left
    link = HostLink(0, host, str(silent))
    assert link.close(timeout=0.5) == {}
    assert link.unanswered == "no answer to 'finish' within 0.5 s"


def test_a_mirror_taken_over_sends_only_what_the_controller_lacks(tmp_path: Path) -> None:
    """A file whose first bytes the controller holds (same digest) continues from there; one whose
    prefix differs (rewritten since) or that the controller lacks is sent whole."""
    from harness.controller.host_mirror import Mirror, sha256_of

    d = tmp_path / "m" / "run"
    d.mkdir(parents=True)
    (d / "grown.jsonl").write_bytes(b"step 1\nstep 2\n")
    (d / "rewritten.json").write_bytes(b'{"status": "ok"}')
    (d / "new.txt").write_bytes(b"new")
    known = {"m/run/grown.jsonl": [7, sha256_of(d / "grown.jsonl", 7)],
             "m/run/rewritten.json": [4, "0" * 64]}  # what the controller held is not this file's start
    mirror = Mirror(tmp_path, [str(d)])
    assert mirror.resume(known) == 1
    sent: list[dict] = []
    mirror.scan(sent.append)
    got = {m["path"]: (m["offset"], base64.b64decode(m["data"])) for m in sent}
    assert got == {"m/run/grown.jsonl": (7, b"step 2\n"), "m/run/rewritten.json": (0, b'{"status": "ok"}'),
                   "m/run/new.txt": (0, b"new")}
    assert sha256_of(d / "new.txt", 4) is None  # shorter than the prefix asked: no digest


def _agent_with_a_run(tmp_path: Path) -> tuple[Any, Any, Path]:
    """An agent on this machine (no SSH) holding a run's directory, as at a run's start."""
    from harness.cluster_spec import LOCAL
    from harness.controller.host_link import HostLink
    from harness.controller.remote import RemoteRanks

    host = ClusterHost(LOCAL, [LOCAL])
    link = HostLink(0, host, sys.executable)
    root = tmp_path / "mlx-ddp-harness-run"
    assert link.request("setup", root=str(root))["ok"]
    link.root = str(root)
    hosts = RemoteRanks(Cluster([host]), [0], finish_timeout_s=2.0)
    hosts.links[0] = link
    return hosts, link, root


def test_a_hung_agent_is_ended_by_a_second_that_kills_what_works_in_the_runs_directory(tmp_path: Path) -> None:
    """The first agent is stopped (it cannot answer); a process it never recorded works in the run's
    directory. The second agent ends the first, kills that process and removes the directory
    (stand-in processes: the agents' protocol, not DDP)."""
    import psutil

    hosts, first, root = _agent_with_a_run(tmp_path)
    worker = subprocess.Popen(["sleep", "60"], cwd=root / "tmp")
    os.kill(first.proc.pid, signal.SIGSTOP)
    try:
        assert hosts.finish() == []
        assert worker.wait(timeout=5) == -signal.SIGKILL
        assert not root.exists() and not psutil.pid_exists(first.proc.pid)
        assert hosts.notes == [f"host {first.name}: its agent gave no answer at the end (no answer to 'finish' "
                               f"within 2 s); a second agent took over and it finished the run there"]
    finally:
        worker.kill()
        first.proc.kill()


def test_an_agent_whose_link_ended_is_checked_by_a_second_that_finds_the_run_finished(tmp_path: Path) -> None:
    """The first agent's input ends before the run's end: it cleans up by itself and says why on
    stderr. The second agent finds the directory gone; the run is not failed for it."""
    hosts, first, root = _agent_with_a_run(tmp_path)
    assert first.proc.stdin is not None
    first.proc.stdin.close()
    assert first.proc.wait(timeout=10) == 0
    assert hosts.finish() == [] and not root.exists()
    assert len(hosts.notes) == 1 and hosts.notes[0].startswith(
        f"host {first.name}: its agent gave no answer at the end (it had ended with exit code 0, "), hosts.notes
    assert hosts.notes[0].endswith(" s after it started (agent: ended: its input ended (the controller or its SSH "
                                   "link is gone))); a second agent took over and the run's directory there was "
                                   "already gone"), hosts.notes


@pytest.mark.ranks
def test_a_run_on_a_cluster_of_this_machine_goes_through_the_agent_and_leaves_nothing(tmp_path: Path) -> None:
    """127.0.0.1 is the one host mlx.launch starts without SSH: the agent path runs anywhere."""
    from harness.controller.run_job import execute
    from harness.scenario.job import AllSumJob

    work = tmp_path / "hostwork"
    work.mkdir()
    c = Cluster([ClusterHost("127.0.0.1", ["127.0.0.1"])], workdir=str(work))
    o = execute("c", AllSumJob(value=2.0, rounds=3, pause_s=0.05), 2, cluster=c,
                wall_s=120, no_progress_s=60)
    assert o.ok, o.failure
    assert o.hosts == ["127.0.0.1", "127.0.0.1"]
    assert [r.result["sums"] for r in o.ranks] == [[5.0, 9.0, 13.0]] * 2  # (2k + 0) + (2k + 1)
    assert list(work.iterdir()) == []  # the host's run directory is gone


@pytest.mark.ranks
def test_a_hosts_memory_share_is_judged_from_its_agents_figures(tmp_path: Path) -> None:
    """With a share no process fits in, the run on a cluster host is stopped, naming the host."""
    from harness.controller.run_job import execute
    from harness.memory.guard import MemoryLimits
    from harness.scenario.job import AllSumJob

    c = Cluster([ClusterHost("127.0.0.1", ["127.0.0.1"])], workdir=str(tmp_path))
    o = execute("c", AllSumJob(value=1.0, rounds=200, pause_s=0.05), 2, cluster=c,
                wall_s=120, no_progress_s=60, memory=MemoryLimits(machine_fraction=1e-6))
    assert not o.ok and o.watch.limit == "memory", o.failure
    assert "of host 127.0.0.1's memory" in (o.failure or "")
    assert list(tmp_path.iterdir()) == []


def test_a_host_with_other_harness_code_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent on 127.0.0.1 runs a copy of the harness with one line changed: preflight names
    the host and the mismatch; the unchanged copy passes."""
    import shutil

    from harness.controller.host_checks import check_hosts

    copy = tmp_path / "other" / "harness"
    shutil.copytree(REPO / "harness", copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(tmp_path)  # python -m puts the working directory first on its path
    monkeypatch.setenv("PYTHONPATH", str(copy.parent))
    c = Cluster([ClusterHost("127.0.0.1", ["127.0.0.1"])])
    assert [h.problem for h in check_hosts(c)] == [""]
    with open(copy / "controller" / "remote.py", "a") as f:
        f.write("# a host with other code\n")
    (problem,) = [h.problem for h in check_hosts(c)]
    assert problem.startswith("host 127.0.0.1 runs harness source digest ") and "install the same" in problem


# -- simulated hosts ---------------------------------------------------------------------------

WHY_NOT = unavailable()
needs_hosts = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


@pytest.fixture(scope="module")
def sim() -> SimHosts:
    with SimHosts(2, link="relay") as hosts:
        yield hosts


@pytest.fixture(scope="module")
def hostfile(sim: SimHosts, tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("cluster") / "hosts.json"
    hosts = [{"ssh": h.ssh_addr, "ips": [h.data_addr]} for h in sim.hosts]
    f.write_text(json.dumps({"backend": "ring", "hosts": hosts, "harness": {"workdir": sim.private_dir}}))
    return f


def sim_cli(sim: SimHosts, *args: str, timeout: float = 600, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    return cli(*args, timeout=timeout, env={"PATH": sim.path_env["PATH"], **(env or {})})


def assert_nothing_left(sim: SimHosts) -> None:
    for i in range(len(sim.hosts)):
        assert sim.processes(i) == [], f"host {i} still runs {sim.processes(i)}"
        listing = sim.ssh(i, f"ls -A {sim.private_dir}")
        assert listing.returncode == 0 and listing.stdout == "", f"host {i} keeps {listing.stdout!r}"
        assert sim.shared_leftovers(i) == []


def verdicts(result: Path) -> dict[tuple[str, str], str]:
    doc = json.loads(result.read_text())
    return {(c["name"], c["run"]): c["result"] for s in doc["scenarios"] for c in s["checks"]}


ONE_RANK_NA = {"replica_consistency", "ranks_agree"}  # nothing to compare at one rank


def all_pass(v: dict[tuple[str, str], str], runs: dict[str, dict]) -> bool:
    """Every check passed, but those that compare ranks on a one-rank run, which are n/a."""
    return all(r == ("n/a" if name in ONE_RANK_NA and runs[run]["world_size"] == 1 else "pass")
               for (name, run), r in v.items())


def runs_of(result: Path) -> dict[str, dict]:
    doc = json.loads(result.read_text())
    return {r["name"]: r for s in doc["scenarios"] for r in s["runs"]}


@needs_hosts
@pytest.mark.ranks
@pytest.mark.mlx_ddp_world_size(2)
def test_text_parity_across_two_hosts_gives_the_single_host_verdicts(sim: SimHosts, hostfile: Path,
                                                                     tmp_path: Path, shared_run: SharedRun) -> None:
    local, local_out = shared_run(str(TEXT_PARITY))  # the run tests/test_cli.py reads
    across = sim_cli(sim, "run", str(TEXT_PARITY), "--hostfile", str(hostfile), "--out", str(tmp_path / "across"),
                     "--progress", "off")
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-2000:]
    assert across.returncode == 0, across.stdout[-3000:] + across.stderr[-2000:]
    v_local, v_across = verdicts(local_out / "result.json"), verdicts(tmp_path / "across" / "result.json")
    runs = runs_of(tmp_path / "across" / "result.json")
    assert v_across == v_local and all_pass(v_local, runs)
    a, b = sim.hosts[0].ssh_addr, sim.hosts[1].ssh_addr
    assert runs["ddp2"]["hosts"] == [a, b] and runs["ddp4"]["hosts"] == [a, a, b, b]
    assert [rk["host"] for rk in runs["ddp4"]["ranks"]] == [a, a, b, b]
    assert runs["single"]["hosts"] is None  # one process runs on the controller's machine
    assert f"run ddp4 across hosts: {a}: ranks 0,1; {b}: ranks 2,3" in across.stdout
    # each host's agent links the yielding library where the ranks placed there fill its cores
    # (2 of ddp4's ranks per simulated host of this machine's cores), and the ranks map it
    cores = len(os.sched_getaffinity(0))
    yielding = [any(n.startswith("ring_yield-") for n in rk.get("preloaded", [])) for rk in runs["ddp4"]["ranks"]]
    if cores <= 2 and ring_yield.library() is not None:
        assert runs["ddp4"]["ring_yield"].startswith(f"on {a}, {b}: its ranks yield a core while they wait"), runs
        assert yielding == [True] * 4 and f"run ddp4 on ring: on {a}, {b}: its ranks yield" in across.stdout
    assert runs["ddp2"]["ring_yield"] is None  # one rank per host
    assert not any(any(n.startswith("ring_yield-") for n in rk.get("preloaded", [])) for rk in runs["ddp2"]["ranks"])
    assert_nothing_left(sim)


@needs_hosts
@pytest.mark.ranks
@pytest.mark.mlx_ddp_world_size(2)
@pytest.mark.full  # a measured link (a link down mid-run is in every session)
@pytest.mark.parametrize(("delay_ms", "loss"), [(40.0, 0.0), (0.0, 0.03)], ids=["latency", "loss"])
def test_a_slow_or_lossy_link_costs_throughput_but_not_correctness(sim: SimHosts, hostfile: Path, tmp_path: Path,
                                                                   delay_ms: float, loss: float) -> None:
    # text_parity's 20 steps cut to 6 (evaluated at 3 and 6): every step crosses the link in turn,
    # and each check is judged as on the whole run. Its 1- and 2-rank runs: ddp2's one rank a host
    # sends every collective over the link (ddp4's placement across hosts: the test above)
    short = tmp_path / "text_parity.toml"
    text = TEXT_PARITY.read_text()
    for part, by in (("steps = 20\n", "steps = 6\n"), ("eval_every = 10", "eval_every = 3"),
                     ("digest_every = 5", "digest_every = 3"),
                     ('[[runs]]\nname = "ddp4"\nworld_size = 4\n', "")):
        assert part in text, part
        text = text.replace(part, by)
    short.write_text(text)
    sim.set_link(delay_ms=delay_ms, loss=loss, seed=3)
    try:  # every ring rank yields while it waits: the simulated hosts share this machine's cores, and
        # ddp2's two ranks (one a host) would otherwise poll both of them through each delayed transfer
        r = sim_cli(sim, "run", str(short), "--hostfile", str(hostfile), "--out", str(tmp_path / "out"), "--progress",
                    "off", env={ring_yield.VAR: "on"})
    finally:
        sim.set_link()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    runs = runs_of(tmp_path / "out" / "result.json")
    assert all_pass(verdicts(tmp_path / "out" / "result.json"), runs)
    assert set(runs) == {"single", "ddp2", "twin2"}, sorted(runs)
    ddp2 = runs["ddp2"]
    if ring_yield.library() is not None:  # ``on`` reaches a host that holds one rank: only ``on`` makes it yield
        assert ddp2["ring_yield"] and f"{ring_yield.VAR}=on" in ddp2["ring_yield"], runs
        assert all(any(n.startswith("ring_yield-") for n in rk.get("preloaded", [])) for rk in ddp2["ranks"])
    steps = ddp2["ranks"][0]["step_times_s"][1:]
    if delay_ms:  # a step crosses the link at least twice in turn (the ranks' agreement that they
        # built the step, then its gradient all-reduce): twice the added latency, where a step
        # on the plain link takes 30-50 ms on a 2-core machine
        assert sorted(steps)[len(steps) // 2] >= 2 * delay_ms / 1000, steps
    assert f"{ddp2['median_tok_s']:.1f}" in r.stdout  # the run table shows the speed the link allowed
    assert_nothing_left(sim)


LINK_DOWN = REPO / "scenarios" / "link_down.toml"


@needs_hosts
@pytest.mark.ranks
@pytest.mark.mlx_ddp_world_size(2)
def test_a_link_that_goes_down_mid_run_ends_it_within_the_no_progress_limit(sim: SimHosts, hostfile: Path,
                                                                            tmp_path: Path) -> None:
    no_progress_s = 10  # the scenario's
    scenario = LINK_DOWN
    tmp = tmp_path / "controller-tmp"
    tmp.mkdir()
    # its ranks yield while they wait (as above): through the 10 s without progress, both would poll
    # a core each of the machine the simulated hosts share
    proc = subprocess.Popen([sys.executable, "-m", "harness", "run", str(scenario), "--hostfile", str(hostfile),
                             "--progress", "off"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PATH": sim.path_env["PATH"], "TMPDIR": str(tmp), ring_yield.VAR: "on"})
    try:
        deadline = time.monotonic() + 120
        while True:  # rank 1's events come back from its host as it trains
            steps = [ln for f in tmp.glob("mlx-ddp-harness-run-*/rank1.events.jsonl")
                     for ln in f.read_text().splitlines() if '"kind": "step"' in ln]
            if len(steps) >= 5:
                break
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach step 5"
            time.sleep(0.05)
        sim.link_down(1)
        down_at = time.monotonic()
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - down_at
    finally:
        sim.link_up(1)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, out[-2000:] + err[-2000:]
    assert f"no progress from any rank for {no_progress_s} s" in out
    b = sim.hosts[1].ssh_addr
    assert f"rank 1 on {b} after step" in out, out[-2000:]
    assert f"host {b} cannot reach {sim.hosts[0].data_addr}" in out, out[-2000:]  # the link, named
    assert no_progress_s <= took < no_progress_s + 15, took
    assert_nothing_left(sim)


@needs_hosts
def test_an_unreachable_host_is_refused_before_anything_runs(sim: SimHosts, tmp_path: Path) -> None:
    f = tmp_path / "hosts.json"
    hosts = [{"ssh": sim.hosts[0].ssh_addr, "ips": [sim.hosts[0].data_addr]},
             {"ssh": "10.213.250.2", "ips": ["10.214.250.2"]}]
    f.write_text(json.dumps({"hosts": hosts, "harness": {"workdir": sim.private_dir}}))
    r = sim_cli(sim, "run", str(TEXT_PARITY), "--hostfile", str(f), "--out", str(tmp_path / "out"), timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "host 10.213.250.2" in r.stderr and "did not answer" in r.stderr
    assert not (tmp_path / "out").exists()
    assert_nothing_left(sim)


@needs_hosts
@pytest.mark.ranks
@pytest.mark.full  # a measurement between hosts
def test_doctor_reports_each_host_and_the_bandwidth_between_them(sim: SimHosts, hostfile: Path) -> None:
    r = sim_cli(sim, "doctor", "--hostfile", str(hostfile), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for h in sim.hosts:
        assert f"{h.ssh_addr}: SSH" in r.stdout and f"ranks use {h.data_addr}" in r.stdout
        assert f"{h.ssh_addr}: backends" in r.stdout
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("all_sum between hosts"))
    assert float(line.split("bus bandwidth ")[1].split(" MB/s")[0]) > 0
    assert_nothing_left(sim)


@needs_hosts
@pytest.mark.ranks
@pytest.mark.mlx_ddp_world_size(2)
def test_a_cluster_section_runs_a_scenario_whose_data_the_hosts_lack(sim: SimHosts, hostfile: Path,
                                                                     tmp_path: Path) -> None:
    """The data file is where only the controller sees it (the hosts have their own disk at that
    path): it is shipped to each host for the run and gone from them afterwards."""
    hidden = Path(sim.private_dir) / "controller-only"
    hidden.mkdir()
    try:
        rows = hidden / "chat.jsonl"
        rows.write_text((REPO / "scenarios" / "data" / "chat.jsonl").read_text())
        assert sim.ssh(0, f"test -e {rows}").returncode == 1  # not on the host
        body = (REPO / "scenarios" / "chat_jsonl.toml").read_text().replace('path = "data/chat.jsonl"',
                                                                            f'path = "{rows}"')
        scenario = tmp_path / "chat_across.toml"
        scenario.write_text(body + f'\n[cluster]\nhostfile = "{hostfile}"\n')
        r = sim_cli(sim, "run", str(scenario), "--out", str(tmp_path / "out"), "--progress", "off")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        assert runs_of(tmp_path / "out" / "result.json")["ddp2"]["hosts"] == [h.ssh_addr for h in sim.hosts]
        result = tmp_path / "out" / "result.json"
        assert all_pass(verdicts(result), runs_of(result))
    finally:
        for f in hidden.iterdir():
            f.unlink()
        hidden.rmdir()
    assert_nothing_left(sim)


@needs_hosts
@pytest.mark.ranks
@pytest.mark.mlx_ddp_world_size(2)
def test_an_agent_whose_link_is_lost_mid_run_is_taken_over_and_the_run_kept(sim: SimHosts, hostfile: Path,
                                                                           tmp_path: Path) -> None:
    """Host 0's agent hangs (stopped) and its SSH link ends while the ranks train: nothing more of
    rank 0 comes back through it, and it cannot clean up. At the run's end a second agent on that
    host ends the first, sends what rank 0 wrote since, kills what is left and removes the run's
    directory: the run is whole and passes, saying so; nothing stays on the host."""
    import psutil

    scenario = tmp_path / "lost_link.toml"
    text = LINK_DOWN.read_text()
    for part, by in (("steps = 2000\n", "steps = 30\n"), ('name = "link_down"', 'name = "lost_link"')):
        assert part in text, part
        text = text.replace(part, by)
    scenario.write_text(text)
    tmp = tmp_path / "controller-tmp"
    tmp.mkdir()
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "harness", "run", str(scenario), "--hostfile", str(hostfile),
                             "--out", str(out), "--progress", "off"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PATH": sim.path_env["PATH"], "TMPDIR": str(tmp)})
    a = sim.hosts[0].ssh_addr
    try:
        deadline = time.monotonic() + 120
        while not any('"kind": "step"' in f.read_text() for f in tmp.glob("mlx-ddp-harness-run-*/rank0.events.jsonl")):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.05)
        agents = [int(p.split()[0]) for p in sim.processes(0) if "host_agent" in p]
        assert len(agents) == 1, sim.processes(0)
        os.kill(agents[0], signal.SIGSTOP)  # it neither answers nor sees its link end
        links = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "host_agent" in " ".join(p.cmdline()) and a in p.cmdline()]
        assert len(links) == 1, links
        links[0].kill()
        # rank 0 had most of its steps to go: its result (and events since) can only come through the second agent
        assert not any(tmp.glob("mlx-ddp-harness-run-*/rank0.result.json"))
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-2000:]
    run = runs_of(out / "result.json")["ddp2"]
    assert run["ok"] and run["steps"] == 30, run
    note = f"run ddp2: host {a}: its agent gave no answer at the end (it had ended with exit code -9, "
    assert note in stdout and "a second agent took over and it finished the run there" in stdout, stdout[-3000:]
    assert run["notes"] and run["notes"][0].startswith(note[len("run ddp2: "):]), run["notes"]
    assert_nothing_left(sim)


@needs_hosts
@pytest.mark.ranks
@pytest.mark.mlx_ddp_world_size(2)
def test_a_controller_that_dies_leaves_nothing_on_the_hosts(sim: SimHosts, hostfile: Path, tmp_path: Path) -> None:
    """SIGKILL the controller mid-run: each agent sees its SSH session end, kills its ranks and
    removes the host's files; the local launcher then ends too."""
    tmp = tmp_path / "controller-tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "harness", "run", str(LINK_DOWN), "--hostfile", str(hostfile),
                             "--progress", "off"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PATH": sim.path_env["PATH"], "TMPDIR": str(tmp)})
    deadline = time.monotonic() + 120
    while not any('"kind": "step"' in f.read_text() for f in tmp.glob("mlx-ddp-harness-run-*/rank1.events.jsonl")):
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start training"
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while any(sim.processes(i) for i in range(len(sim.hosts))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert_nothing_left(sim)
    # nothing of the run survives on this machine either (its launcher and SSH clients)
    import psutil

    left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
            if any(str(tmp) in part for part in (p.info["cmdline"] or []))]
    deadline = time.monotonic() + 30
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
                if any(str(tmp) in part for part in (p.info["cmdline"] or []))]
    assert left == []
