"""Shared helpers: small scenario files, and the CLI run as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Reports without plots unless a test asks for them (``run --plots``, ``write_outputs(plots=True)``):
# drawing them is most of the controller's CPU in a small run, and tests/test_report.py and
# tests/test_gates.py check them.
os.environ.setdefault("MLX_DDP_HARNESS_PLOTS", "off")
# Four rank slots more than the cores: a DDP run's ranks wait on each other between their steps, and
# some tests' ranks mostly wait (a slowed trainer, a slow link, a hang), so with the budget at the
# cores a core sits idle while the other xdist worker's launch queues for it (docs/development.md).
# With four more, the widest launch of the tests (4 ranks) goes beside a 2-rank one: at two more it
# waited out a hang's no-progress limit or a whole gate, with a core idle. Tests of the budget set their own.
os.environ.setdefault("MLX_DDP_HARNESS_RANK_BUDGET", str((os.cpu_count() or 1) + 4))
# Local CPU ranks start forked from a process that has done their imports (warm starts,
# ``harness.controller.warm_ranks``): a rank's imports are most of a short test run's CPU. Set
# once in the first pytest process, so xdist's workers share the servers; ended at session end.
os.environ.setdefault("MLX_DDP_HARNESS_WARM_RANKS", os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"mlx-ddp-harness-warm-{os.getpid()}"))
EXAMPLE = REPO / "examples" / "ddp_train.py"
WORKER_DIR = REPO / "examples" / "cpp_worker"

# A small, fast scenario body; tests add [[runs]] and override keys as they need.
SMALL = """
[scenario]
name = "{name}"
description = "small test scenario"
seed = 7

[model]
arch = "qwen3"

[data]
rows = 21
max_chars = 60

[train]
steps = {steps}
global_batch = 6
digest_every = 2

[checks]
{reference}
{checks}

[limits]
wall_s = 240
no_progress_s = 90
"""


def write_scenario(tmp: Path, name: str, world_sizes: tuple[int, ...] = (1, 2), steps: int = 4,
                   checks: str = "", extra: str = "") -> Path:
    runs = "".join(
        f'\n[[runs]]\nname = "{"single" if ws == 1 else f"ddp{ws}"}"\nworld_size = {ws}\n' for ws in world_sizes
    )
    reference = 'reference = "single"' if 1 in world_sizes else ""
    body = textwrap.dedent(SMALL).format(name=name, steps=steps, checks=checks, reference=reference) + runs + extra
    path = tmp / f"{name}.toml"
    path.write_text(body)
    return path


def script_scenario(d: Path, script: str, name: str = "script", world_sizes: tuple[int, ...] = (1, 2),
                    extra: str = "", no_progress_s: int = 60) -> Path:
    """A scenario running the user script ``script`` (written beside it) as its trainer."""
    (d / f"{name}.py").write_text(script)
    runs = "".join(f'\n[[runs]]\nname = "{"single" if n == 1 else f"ddp{n}"}"\nworld_size = {n}\n'
                   for n in world_sizes)
    reference = '[checks]\nreference = "single"\n' if 1 in world_sizes else ""
    body = textwrap.dedent(f"""
        [scenario]
        name = "{name}"
        seed = 5

        [trainer]
        kind = "script"
        path = "{name}.py"

        [model]
        arch = "llama"

        [data]
        format = "prompt_completion"
        rows = 32

        [train]
        steps = 6
        global_batch = 8
        digest_every = 3

        [limits]
        wall_s = 240
        no_progress_s = {no_progress_s}
        """) + runs + "\n" + reference + extra
    path = d / f"{name}.toml"
    path.write_text(body)
    return path


def cli(*args: str, cwd: Path | None = None, timeout: float = 600,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m harness ARGS`` in a fresh process (``env``: variables added to this one's)."""
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, timeout=timeout, env={**os.environ, **(env or {})})


class SharedRun:
    """One ``run`` of the harness that every test of the session asking for the same arguments
    reads: its process (returncode, stdout, stderr) and its ``--out`` directory. Tests that only
    read a run's outputs share it, under pytest-xdist too: the first worker to ask runs it while
    holding a lock; the others wait for it and read what it wrote. A test that holds rank slots
    (``mlx_ddp_world_size``) never waits for another worker's run, which may be waiting for those
    slots: while that run is under way it runs its own."""

    def __init__(self, root: Path):
        self.root = root

    def __call__(self, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
        import fcntl
        import hashlib
        import json
        import tempfile

        from harness.controller.rank_budget import held_here

        key = hashlib.sha256("\0".join(args).encode()).hexdigest()[:16]
        home = self.root / key
        home.mkdir(parents=True, exist_ok=True)
        out, done = home / "out", home / "process.json"
        with open(home / ".lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (fcntl.LOCK_NB if held_here() else 0))
            except BlockingIOError:
                own = Path(tempfile.mkdtemp(dir=home, prefix="own-"))
                return cli("run", *args, "--out", str(own)), own
            if not done.exists():
                p = cli("run", *args, "--out", str(out))
                done.write_text(json.dumps({"args": list(p.args), "returncode": p.returncode, "stdout": p.stdout,
                                            "stderr": p.stderr}))
        d = json.loads(done.read_text())
        return subprocess.CompletedProcess(d["args"], d["returncode"], d["stdout"], d["stderr"]), out


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory: pytest.TempPathFactory) -> SharedRun:
    """``shared_run(*run_args)``: ``SharedRun``, in a directory every xdist worker of this session sees."""
    base = tmp_path_factory.getbasetemp()
    return SharedRun((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs")


@pytest.fixture(scope="session")
def worker() -> Path:
    """The C++ worker, built against the mlx wheel of this interpreter (skipped without g++); one
    build for all xdist workers, the others wait for it."""
    import fcntl
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: the C++ worker cannot be built")
    (WORKER_DIR / "build").mkdir(exist_ok=True)
    with open(WORKER_DIR / "build" / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(["bash", str(WORKER_DIR / "build.sh"), sys.executable], check=True, timeout=300)
    return WORKER_DIR / "build" / "worker"


@pytest.fixture
def scenario_dir(tmp_path: Path) -> Path:
    d = tmp_path / "scenarios"
    d.mkdir()
    return d


BENCHMARK_OUTPUT = ("benchmark_json", "benchmark_save", "benchmark_autosave", "benchmark_compare",
                    "benchmark_compare_fail", "benchmark_histogram")


def pytest_configure(config: pytest.Config) -> None:
    """pytest-benchmark silently records nothing under xdist; asking it for output there is a mistake.
    And the harness's bytecode, compiled once for the session's processes (see ``compile_harness``)."""
    if not hasattr(config, "workerinput"):
        compile_harness()
    xdist = bool(config.getoption("numprocesses", None)) or config.getoption("dist", "no") != "no"
    asked = [f"--{o.replace('_', '-')}" for o in BENCHMARK_OUTPUT if config.getoption(o, None)]
    if xdist and asked:
        raise pytest.UsageError(f"{', '.join(asked)} record nothing under xdist (-n): pytest-benchmark disables "
                                f"itself there; run the benchmarks without -n: pytest -m throughput {' '.join(asked)}")


def compile_harness() -> None:
    """Write the harness's bytecode where Python would not (``PYTHONDONTWRITEBYTECODE``, set on
    some CI images): each of the session's hundreds of controller, launcher and rank processes
    would otherwise compile every harness module it imports from source (``python -m harness
    --help``: 0.19 to 0.23 CPU-s so, 0.16 to 0.17 with bytecode). Up-to-date bytecode is left as it is."""
    import compileall
    import py_compile

    if sys.dont_write_bytecode and os.access(REPO / "harness", os.W_OK):  # timestamped, as imports write them
        compileall.compile_dir(REPO / "harness", quiet=2, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)


FULL_ONLY = "in the full set of tests, which pytest --all runs (docs/development.md#the-full-set)"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--all", action="store_true", default=False, dest="full_set",
                     help="also run the tests marked full: the full set's shipped scenarios, the trainers' "
                          "power sets, the benchmarks' and measured links' tests, second demonstrations")


def full_set(config: pytest.Config) -> bool:
    """Whether this session runs the full set (``pytest --all``)."""
    return bool(config.getoption("full_set", False))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``full`` skip, saying how to run them, unless ``--all`` is given. Modules with
    tests that launch ranks first, each whole and in its order (its module fixtures made once), the
    rest after: under ``-n`` the last tests to run are short ones, so no worker ends its share long
    before the other."""
    if not full_set(config):
        for item in items:
            if item.get_closest_marker("full") is not None:
                item.add_marker(pytest.mark.skip(reason=FULL_ONLY))
    launching = {getattr(item, "module", None) for item in items if item.get_closest_marker("ranks") is not None}
    items.sort(key=lambda item: getattr(item, "module", None) not in launching)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under ``-n`` with xdist's default ``load`` distribution, work stealing: each worker starts
    with half the tests and an idle one takes half of what another has not begun. ``load`` sends
    tests ahead in batches, and a worker finished its batch 39 s before the other had run its own."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker more than the cores this process may use. Tests wait part of their
    time (a hang's no-progress limit, a slowed trainer, ranks sleeping on a slow link): with a
    worker a core, 14 % of the cores sat idle in a fresh-clone run; with one more, 5 %. The rank
    budget above still caps the ranks at once. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` decides where
    set, as in xdist's own answer (docs/development.md)."""
    asked = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").strip()
    if asked:
        try:
            return int(asked)
        except ValueError:
            import warnings

            warnings.warn(f"PYTEST_XDIST_AUTO_NUM_WORKERS={asked!r} is not a number: ignored", stacklevel=1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores + 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The first pytest process (not an xdist worker) ends the warm-start servers it set up."""
    import shutil

    from harness.controller.warm_ranks import stop_servers

    directory = Path(os.environ["MLX_DDP_HARNESS_WARM_RANKS"])
    if not hasattr(session.config, "workerinput") and directory.name == f"mlx-ddp-harness-warm-{os.getpid()}":
        if directory.is_dir():
            stop_servers(directory)
            shutil.rmtree(directory, ignore_errors=True)


def needs_unsloth() -> None:
    """Skip, with the install line, where unsloth-zoo (an extra installed without its
    dependencies) is missing."""
    import importlib.util

    if importlib.util.find_spec("unsloth_zoo") is None:
        pytest.skip("unsloth-zoo is not installed: pip install --no-deps 'unsloth_zoo>=2026.10.9'")


def train_result(**fields: object) -> dict:
    """A training rank's result as the controller reads it (``schema.check_rank_result``): every
    required key with a neutral value, then ``fields``."""
    from harness import schema

    steps = len(fields.get("losses") or [0.0])  # type: ignore[arg-type]
    record: dict = {
        "rank": 0, "pid": 1, "host": "h", "job": "train", "status": "ok", "trainer": {"kind": "reference"},
        "steps": steps, "steps_planned": steps, "steps_start": 1, "losses": [0.0] * steps,
        **{k: [0.0] * steps for k in ("step_times_s", "tok_s_local", "tok_s_global", "learning_rates")},
        "tokens_local_per_step": [0] * steps, "tokens_global_per_step": [0] * steps, "tokens_local": 0,
        "tokens_global": 0, "input_widths": [], "runtime_s": 1.0, "train_time_s_total": 1.0, "resume": None,
        "digests": {}, "final_digest": "d", "param_count": 0, "model_config": None, "evals": [], "stop": None,
        "compile": {"mode": "off", "scope": "none", "fallback_reason": None}, "side_effects": {"saves": 0},
        "data": {"streaming": False, "bytes_held": 0}, "rss_step_peak_bytes": 0, "seed_used": 0,
        "precision": {}, "global_rng_untouched": True, "probes": None,
        "dtype_changes": {"compared": 1, "changed_count": 0, "changed": []},
    }
    record.update(fields)
    return schema.check_rank_result(record, "test result")
