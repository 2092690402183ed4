"""Where the suite's CPU goes: ``PYTHONPATH=. pytest -p tests.cpu_plugin -n auto`` records each
test's wall time and the CPU seconds of its process and of the children it reaped
(``RUSAGE_SELF`` and ``RUSAGE_CHILDREN`` around the test), one JSON line per test in
``MLX_DDP_HARNESS_CPU_LOG`` (default ``.pytest_cache/cpu.jsonl``), and prints at the end the
CPU-seconds, the share of the workers' time they fill and the costliest files and tests.

A child is counted when it is reaped: the ranks of a launch by the test that launched them, but
processes a module-scoped fixture keeps (the simulated hosts of ``tests/test_cluster.py``) by
the test during which they end.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import pytest

LOG_VAR = "MLX_DDP_HARNESS_CPU_LOG"


def _log(config: pytest.Config) -> Path:
    return Path(os.environ.get(LOG_VAR) or config.rootpath / ".pytest_cache" / "cpu.jsonl")


def _cpu() -> tuple[float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller starts the log; workers append
        log = _log(config)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        os.environ[LOG_VAR] = str(log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    own0, kids0 = _cpu()
    t0 = time.time()
    yield
    own1, kids1 = _cpu()
    line = {"id": item.nodeid, "start": t0, "wall": time.time() - t0, "self": own1 - own0, "kids": kids1 - kids0,
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
    with open(_log(item.config), "a") as f:
        f.write(json.dumps(line) + "\n")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rows = [json.loads(x) for x in _log(config).read_text().splitlines() if x.strip()]
    if not rows:
        return
    cpu = {r["id"]: r["self"] + r["kids"] for r in rows}
    span = max(r["start"] + r["wall"] for r in rows) - min(r["start"] for r in rows)
    workers = len({r["worker"] for r in rows})
    total = sum(cpu.values())
    by_file: collections.Counter[str] = collections.Counter()
    for r in rows:
        by_file[r["id"].split("::")[0]] += cpu[r["id"]]
    write = terminalreporter.write_line
    terminalreporter.section("CPU use")
    write(f"{total:.0f} CPU-s over {span:.0f} s of {workers} worker(s): {total / (span * workers):.0%} of them busy "
          f"(per test in {_log(config)})")
    for name, seconds in by_file.most_common(8):
        write(f"{seconds:7.1f} CPU-s  {name}")
    for name, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])[:8]:
        write(f"{seconds:7.1f} CPU-s  {name}")
