"""Scenarios across simulated hosts, on a plain link and on faulty ones (Linux, root).

Two simulated hosts (network namespaces with an SSH server each, ``tests/simhosts.py``; their
data link goes through ``tests/linkrelay.py``, which adds latency and loss where the kernel has no
netem). For each link condition, ``text_parity`` runs with ``--hostfile`` (ddp2: one rank per
host, ddp4: two per host) and the table shows each run's verdicts and median tok/s, and the
same on this machine alone. Then ``scenarios/link_down.toml`` (a long 2-rank run) has host 1's
data link taken down after its
5th step (``--down-repeats`` times): the figure is the time from the link going down to the moment
every process of the run is gone on every host, under a no-progress limit of ``--no-progress-s``.

usage: sudo python benchmarks/cluster_links.py [--delays 15,50] [--losses 0.03] [--down-repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


from harness.cluster_spec import load_hostfile  # noqa: E402
from harness.controller.run_job import execute  # noqa: E402
from harness.scenario import load_scenario  # noqa: E402
from harness.scenario.plan import job_for  # noqa: E402
from tests.simhosts import SimHosts, unavailable  # noqa: E402

TEXT_PARITY = REPO / "scenarios" / "text_parity.toml"


PARITY = ("step_loss_parity", "step_grad_parity", "loss_parity", "param_parity", "eval_parity")
parity_rows: list[list[str]] = []


def run_text_parity(out: Path, env: dict[str, str], hostfile: Path | None, label: str = "") -> list[list[str]]:
    args = [sys.executable, "-m", "harness", "run", str(TEXT_PARITY), "--out", str(out), "--progress", "off"]
    r = subprocess.run([*args, *(["--hostfile", str(hostfile)] if hostfile else [])], env=env, cwd=REPO,
                       capture_output=True, text=True)
    doc = json.loads((out / "result.json").read_text())
    s = doc["scenarios"][0]
    checks = s["checks"]
    rows = []
    for run in s["runs"]:
        if run["name"] not in ("ddp2", "ddp4"):
            continue
        mine = [c for c in checks if c["run"] == run["name"]]
        passed = sum(c["result"] == "pass" for c in mine)
        rows.append([run["name"], f"{run.get('median_tok_s') or 0:.0f}", f"{passed}/{len(mine)} pass",
                     f"exit {r.returncode}"])
        if label:
            value = {c["name"]: c for c in mine}
            parity_rows.append([label, run["name"], *(f"{value[n]['value']:.3g} ({value[n]['result']})"
                                                      if n in value else "-" for n in PARITY)])
    return rows


def link_down(sim: SimHosts, hostfile: Path, no_progress_s: float) -> tuple[float, str]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "link_down.toml"
        path.write_text((REPO / "scenarios" / "link_down.toml").read_text().replace(
            "no_progress_s = 10", f"no_progress_s = {no_progress_s:g}"))
        s = load_scenario(path)
        keep = Path(d) / "kept"
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(out=execute(
            "ddp2", job_for(s, s.runs[0].name), 2, wall_s=300, no_progress_s=no_progress_s,
            cluster=load_hostfile(hostfile), keep_to=keep)))
        t.start()
        tmp = Path(tempfile.gettempdir())
        while True:
            steps = [ln for f in tmp.glob("mlx-ddp-harness-run-*/rank1.events.jsonl")
                     for ln in f.read_text().splitlines() if '"kind": "step"' in ln]
            if len(steps) >= 5 or not t.is_alive():
                break
            time.sleep(0.02)
        sim.link_down(1)
        down = time.time()
        t.join()
        sim.link_up(1)
        out = box["out"]
        left = [p for i in range(len(sim.hosts)) for p in sim.processes(i)]
        kept = [sim.ssh(i, f"ls -A {sim.private_dir}").stdout.strip() for i in range(len(sim.hosts))]
        assert not left and not any(kept), (left, kept)
        return out.watch.ended_at - down, (out.failure or "").splitlines()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delays", default="15,50", help="one-way latencies to add, ms")
    ap.add_argument("--losses", default="0.03", help="packet loss fractions to try")
    ap.add_argument("--down-repeats", type=int, default=3)
    ap.add_argument("--no-progress-s", type=float, default=10.0)
    args = ap.parse_args()
    why = unavailable()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as d, SimHosts(2, link="relay") as sim:
        hostfile = Path(d) / "hosts.json"
        hosts = [{"ssh": h.ssh_addr, "ips": [h.data_addr]} for h in sim.hosts]
        hostfile.write_text(json.dumps({"hosts": hosts, "harness": {"workdir": sim.private_dir}}))
        env = sim.path_env
        for run in run_text_parity(Path(d) / "local", env, None, "this machine alone"):
            rows.append(["this machine alone", *run])
        conditions = [("plain", 0.0, 0.0)] + [(f"+{x} ms one way", float(x), 0.0) for x in args.delays.split(",") if x]
        conditions += [(f"{float(p):.0%} loss", 0.0, float(p)) for p in args.losses.split(",") if p]
        for label, delay, loss in conditions:
            sim.set_link(delay_ms=delay, loss=loss, seed=1)
            for run in run_text_parity(Path(d) / label.replace(" ", "_"), env, hostfile, f"2 hosts, {label}"):
                rows.append([f"2 hosts, {label}", *run])
            print(tabulate(rows[-2:], tablefmt="plain"), flush=True)
        sim.set_link()
        print()
        print(tabulate(rows, headers=["link", "run", "median tok/s", "checks", "CLI"]))
        print()
        print(tabulate(parity_rows, headers=["link", "run", *PARITY]))
        os.environ["PATH"] = env["PATH"]
        tries = [link_down(sim, hostfile, args.no_progress_s) for _ in range(args.down_repeats)]
        times = [t for t, _ in tries]
        print(f"\nlink down after step 5 (no-progress limit {args.no_progress_s:g} s): "
              f"median {statistics.median(times):.2f} s, max {max(times):.2f} s to no process left on any host")
        print(f"failure: {tries[-1][1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
