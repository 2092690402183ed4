"""pytest plugin: scenario files as tests, and a fixture that runs scenarios from Python tests.

Installed with the package (entry point ``pytest11``), it collects nothing until used:

- ``pytest path/to/scenarios/`` collects every scenario file (a TOML file with a ``[scenario]``
  table) of the default set (``default = true``) under a directory named on the command line (each
  other scenario file there is one skipped test saying so), and ``pytest path/to/file.toml`` that
  file; ``--mlx-ddp`` (or ``mlx_ddp = true`` in the ini file) collects scenario files wherever pytest walks.
- Each run of a scenario is a collector with one test per check the scenario plans for it
  (``text_parity.toml::ddp2::loss_parity``), plus ``launch``: the run completed (a run that
  crashed or hung fails here, with the harness's one-line cause). So ``-k loss_parity`` selects
  checks and ``--junitxml`` lists each one. A check the scenario expects to fail
  (``[checks.expected_failures]``) is ``xfail`` while its behaviour is shown, ``XPASS(strict)``
  (a failure) when it is gone, and skipped when it is inconclusive (``harness.judge.behaviours``).
- The scenario runs once, at its first selected test, and its tests report its verdict; a failed
  check names its value and limit, and the report holds the scenario's check table and the
  directory of its artifacts (``--mlx-ddp-out``, default: pytest's temporary directory).
- Under pytest-xdist's default ``load`` distribution a scenario's tests stay on one worker.

The ``mlx_ddp`` fixture runs a scenario file, TOML text or dict and returns its ``ScenarioResult``.
``@pytest.mark.mlx_ddp_world_size(n)`` declares a test's world size: it holds n of the machine's
rank slots (``harness.controller.rank_budget``) from setup to teardown, and the launches it makes
use them. While a scenario runs, a progress line per run comes every ``--mlx-ddp-progress``
seconds through pytest's terminal reporter.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

from harness.present.live import PLAIN_EVERY_S, PlainProgress
from harness.present.pytest_support import benchmark_fixture, describe, named_paths, record_steps, scenario_toml
from harness.present.scenario_result import ScenarioResult, run_scenario_file, scenario_from
from harness.scenario import Scenario, ScenarioError, load_scenario, with_device
from harness.scenario.availability import runnable
from harness.scenario.names import DEVICES


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mlx-ddp", "mlx-ddp-harness scenarios")
    group.addoption("--mlx-ddp", action="store_true", default=None,
                    help="collect scenario files (TOML with a [scenario] table) wherever pytest walks")
    group.addoption("--mlx-ddp-out", metavar="DIR", default=None,
                    help="directory for each scenario's result.json, report.md and rank logs "
                         "(default: under pytest's temporary directory)")
    group.addoption("--mlx-ddp-backend", default=None, choices=("ring", "nccl", "mpi", "jaccl"),
                    help="distributed backend of every run that names none")
    group.addoption("--mlx-ddp-device", default=None, choices=DEVICES,
                    help="the device of every run, over the scenarios' [train] device")
    group.addoption("--mlx-ddp-benchmark", action="store_true", default=False,
                    help="record each run's post-step-1 step times as a pytest-benchmark benchmark "
                         "(FILE::RUN::throughput[SCENARIO-RUN]), for --benchmark-autosave / --benchmark-compare")
    group.addoption("--mlx-ddp-progress", type=float, default=PLAIN_EVERY_S, metavar="S",
                    help="while a scenario runs, a progress line per run every S seconds (0: none; "
                         "not from xdist workers, which have no terminal)")
    group.addoption("--mlx-ddp-all", action="store_true", default=False,
                    help="a directory stands for its full set (full = true), not only its default set (default = true)")
    group.addoption("--mlx-ddp-memory-budget", metavar="SIZE", default=None,
                    help="memory every launch on this machine shares, e.g. 6GB (sets MLX_DDP_HARNESS_MEMORY_BUDGET, "
                         "which xdist workers share; default: the working set)")
    parser.addini("mlx_ddp", type="bool", default=False, help="collect scenario files wherever pytest walks")


WORLD_SIZE_MARKER = "mlx_ddp_world_size"
_HELD = pytest.StashKey[Any]()


def pytest_configure(config: pytest.Config) -> None:
    from harness.ablation import refuse

    refused = refuse("pytest with the mlx-ddp-harness plugin")
    if refused:
        raise pytest.UsageError(refused)
    budget = config.getoption("--mlx-ddp-memory-budget", None)
    if budget is not None:  # xdist workers get the option (and inherit the variable) too
        from harness.memory.plan import BUDGET_VAR, parse_size

        try:
            os.environ[BUDGET_VAR] = str(parse_size(budget))
        except ValueError as e:
            raise pytest.UsageError(f"--mlx-ddp-memory-budget: {e}") from None
    config.addinivalue_line("markers", f"{WORLD_SIZE_MARKER}(n): the test runs up to n ranks at once; it holds n of "
                                       "the machine's rank slots from setup to teardown (its own launches use them)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked with its world size takes that many rank slots before anything of it runs
    (queueing under xdist like any launch); launches it makes count them as theirs."""
    from harness.controller import rank_budget

    mark = item.get_closest_marker(WORLD_SIZE_MARKER)
    if mark is None:
        return
    n = mark.args[0] if mark.args else mark.kwargs.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{WORLD_SIZE_MARKER} takes a world size of at least 1, "
                                f"got {n!r}")
    slots = rank_budget.hold(n, f"test {item.nodeid}")
    item.stash[_HELD] = (slots, os.environ.get(rank_budget.HELD_VAR))
    os.environ[rank_budget.HELD_VAR] = str(rank_budget.held_here() + len(slots.held))


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> Any:
    yield
    held = item.stash.get(_HELD, None)
    if held is not None:
        from harness.controller import rank_budget

        slots, before = held
        slots.release()
        if before is None:
            os.environ.pop(rank_budget.HELD_VAR, None)
        else:
            os.environ[rank_budget.HELD_VAR] = before
        del item.stash[_HELD]


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.suffix != ".toml":
        return None
    config = parent.config
    path = file_path.resolve()
    named = named_paths(config)
    explicit = path in named
    walked = any(d in path.parents for d in named if d.is_dir())
    if not (explicit or walked or config.getoption("--mlx-ddp") or config.getini("mlx_ddp")):
        return None
    data = scenario_toml(path)
    if data is None:
        return None
    head = data["scenario"] if data else {}
    chosen = head.get("full", head.get("default", False)) if config.getoption("--mlx-ddp-all") else head.get("default")
    if not explicit and data and not chosen:
        # a directory stands for its default set, as on the command line; the others show as skipped
        return NotDefaultFile.from_parent(parent, path=file_path) if walked else None
    return ScenarioFile.from_parent(parent, path=file_path)


class NotDefaultFile(pytest.File):
    """A scenario file outside its directory's default set: one skipped test saying how to run it."""

    def collect(self) -> Any:
        yield NotDefault.from_parent(self, name="not_in_default_set")


class NotDefault(pytest.Item):
    def runtest(self) -> None:
        pytest.skip(f"{self.path.name} has no default = true: a directory runs its default set; "
                    f"name the file, or pass --mlx-ddp-all, to run it")

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"{self.path.name}: not in the default set"


class ScenarioFile(pytest.File):
    """One scenario file: a collector per run; runs the scenario once, at its first test."""

    scenario: Scenario
    _result: ScenarioResult | None = None

    def collect(self) -> Any:
        from harness.judge.behaviours import reason_for
        from harness.scenario.plan import plan_scenario

        full = load_scenario(self.path)
        kept, skipped = runnable(full)  # runs whose trainer is not installed here are skipped
        self.scenario = kept if kept is not None else full
        plan = plan_scenario(kept).checks() if kept is not None else {}
        for spec in full.runs:
            run = RunNode.from_parent(self, name=spec.name)
            run.skip = skipped.line() if skipped and (skipped.whole or spec.name in skipped.runs) else None
            run.checks = plan.get(spec.name, [])
            run.expected = {n: reason_for(self.scenario.checks.expected_failures, n, spec.name)
                            for n in run.checks}
            run.expect_error = spec.fails_by_design
            yield run

    def result(self) -> ScenarioResult:
        if self._result is None:
            config = self.config
            out = config.getoption("--mlx-ddp-out")
            base = Path(out) if out else config._tmp_path_factory.mktemp("mlx-ddp", numbered=True)  # noqa: SLF001
            self._result = run_scenario_file(with_device(self.scenario, config.getoption("--mlx-ddp-device")), base,
                                             config.getoption("--mlx-ddp-backend"), progress_lines(config))
        return self._result

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, ScenarioError):
            return f"bad scenario: {excinfo.value}"
        return super().repr_failure(excinfo)


class RunNode(pytest.Collector):
    """One run of a scenario: its ``launch`` test and a test per planned check."""

    checks: list[str]
    expected: dict[str, str | None]
    expect_error: bool
    skip: str | None = None  # why this machine cannot run it

    def collect(self) -> Any:
        if self.skip is not None:
            yield SkippedLaunch.from_parent(self, name="launch")
            return
        if not self.expect_error:
            yield LaunchItem.from_parent(self, name="launch")
            if self.config.getoption("--mlx-ddp-benchmark"):
                yield ThroughputItem.from_parent(self, name=f"throughput[{self.parent.scenario.name}-{self.name}]")
        for name in self.checks:
            item = CheckItem.from_parent(self, name=name)
            reason = self.expected.get(name)
            if reason is not None:
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
            yield item


class ScenarioItem(pytest.Item):
    """A test whose outcome comes from its scenario's verdict."""

    @property
    def scenario_file(self) -> ScenarioFile:
        node = self.parent
        while not isinstance(node, ScenarioFile):
            node = node.parent
        return node

    @property
    def run_name(self) -> str:
        return self.parent.name

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"{self.scenario_file.scenario.name}::{self.run_name}::{self.name}"

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, VerdictFailure | ScenarioError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def _sections(self, result: ScenarioResult) -> None:
        self.add_report_section("call", "scenario", f"{result.table}\nartifacts: {result.artifacts}")


class VerdictFailure(AssertionError):
    """A check or a run that failed: the message is the whole report line."""


class SkippedLaunch(ScenarioItem):
    """A run this machine cannot run (its trainer is not installed): skipped, saying why."""

    def runtest(self) -> None:
        pytest.skip(self.parent.skip)


# A launch test's JUnit properties: the run's measured figures (its scenario's first test holds
# the time of every run, which all run there), and how long the run queued for rank slots.
RUN_PROPERTIES = ("world_size", "backend", "wall_s", "queued_s", "runtime_s", "median_tok_s")


class LaunchItem(ScenarioItem):
    """The run completed (its checks are the plan's: ``harness.scenario.checks``)."""

    def runtest(self) -> None:
        result = self.scenario_file.result()
        self._sections(result)
        figures = next((r for r in result.summary["runs"] if r["name"] == self.run_name), {})
        self.user_properties += [(k, figures[k]) for k in RUN_PROPERTIES if figures.get(k) is not None]
        run = result.runs[self.run_name]
        if not run.ok:
            raise VerdictFailure(f"run {run.name} (world size {run.world_size}) did not complete: {run.failure}")


class CheckItem(ScenarioItem):
    """One check of one run."""

    def runtest(self) -> None:
        result = self.scenario_file.result()
        self._sections(result)
        found = [c for c in result.checks_of(self.run_name) if c.name == self.name]
        run = result.runs[self.run_name]
        if not found:
            cause = (run.failure or "").splitlines()[0] if run.failure else "no result"
            why = (f"run {self.run_name} did not complete: {cause}" if not run.ok and not self.parent.expect_error
                   else f"{self.name} was not judged for run {self.run_name}")
            pytest.skip(why)
        for c in found:
            self.user_properties += [(k, v) for k, v in (("value", c.value), ("limit", c.limit), ("result", c.result))
                                     if v is not None]
            if not c.applicable:
                pytest.skip(c.detail)
            if c.result in ("inconclusive", "INCONCLUSIVE"):
                pytest.skip(c.detail)
            measured_pass = (not c.passed) if c.xfail is not None else c.passed
            if not measured_pass:
                raise VerdictFailure(describe(c))


class ThroughputItem(ScenarioItem):
    """The run's optimizer steps after the first, as pytest-benchmark rounds (seconds per step as
    the ranks timed them), with tok/s, world size, device and backend in ``extra_info``."""

    def runtest(self) -> None:
        result = self.scenario_file.result()
        run = result.runs[self.run_name]
        if not run.ok:
            pytest.skip(f"run {self.run_name} did not complete")
        r = run.result
        tokens, tok_s = r.get("tokens_global_per_step", [])[1:], r.get("tok_s_global", [])[1:]
        if len(tok_s) < 2:
            pytest.skip(f"run {self.run_name} trained {len(tok_s) + 1} steps: fewer than 2 after the first")
        fixture = benchmark_fixture(self)
        seconds = [n / v for n, v in zip(tokens, tok_s, strict=True)]
        record_steps(fixture, seconds, {
            "scenario": result.name, "run": self.run_name, "world_size": run.world_size,
            "device": r.get("device"), "backend": r.get("backend"),
            "median_tok_s": sorted(tok_s)[len(tok_s) // 2], "tokens_per_step": sorted(tokens)[len(tokens) // 2]})


def progress_lines(config: pytest.Config) -> Any:
    """Periodic progress lines through pytest's terminal reporter, in its style (None: turned off,
    or an xdist worker, whose output no terminal shows)."""
    every = config.getoption("--mlx-ddp-progress")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if not every or every <= 0 or reporter is None or hasattr(config, "workerinput"):
        return None
    capture = config.pluginmanager.get_plugin("capturemanager")

    def write(line: str) -> None:  # mid-test: past the test's output capture, as pytest's live logs go
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            writer = getattr(reporter, "_tw", None)  # mid-line after -q's dots: start a line of our own
            if writer is not None and getattr(writer, "width_of_current_line", 0):
                reporter.write("\n")
            reporter.write_line(f"[mlx-ddp] {line.strip()}", cyan=True)

    return PlainProgress(write, every)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    from harness.present.pytest_support import summary_lines

    lines = summary_lines(terminalreporter.stats, config.getoption("--mlx-ddp-out"))
    if lines:
        terminalreporter.write_sep("=", "mlx-ddp summary")
        for line in lines:
            terminalreporter.write_line(line)


def _scenarios_in_play(config: pytest.Config) -> bool:
    """Whether this session may collect scenario files (a TOML file named, or under a directory
    named, or collection everywhere asked for); otherwise xdist's own scheduling is kept."""
    if config.getoption("--mlx-ddp") or config.getini("mlx_ddp"):
        return True
    return any(p.suffix == ".toml" or p.is_dir() and next(p.rglob("*.toml"), None) is not None
               for p in named_paths(config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``-n`` with the default ``load`` distribution, keep each scenario file's tests on one
    worker (they share one execution); every other test is scheduled on its own, as ``load`` does."""
    if config.getvalue("dist") != "load" or not _scenarios_in_play(config):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ScenarioScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.endswith(".toml") else nodeid

    return ScenarioScopes(config, log)


@pytest.fixture
def mlx_ddp(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """``mlx_ddp(scenario)`` runs a scenario (a path, TOML text or a dict of the file's tables)
    and returns its ``ScenarioResult``; artifacts go under the test's ``tmp_path``."""
    backend = request.config.getoption("--mlx-ddp-backend")

    def run(scenario: Path | str | dict[str, Any], backend: str | None = backend) -> ScenarioResult:
        s = scenario_from(scenario, tmp_path)
        if (skipped := runnable(s)[1]) is not None:  # a test asserts on every run: skip it whole
            pytest.skip(skipped.line())
        s = with_device(s, request.config.getoption("--mlx-ddp-device"))
        return run_scenario_file(s, tmp_path / "artifacts", backend, progress_lines(request.config))

    return run
