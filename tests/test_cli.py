"""The command line end to end, with real ranks: exit codes 0/1/2/3, tables, result.json, report.md."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SharedRun, cli, write_scenario


@pytest.mark.ranks
def test_text_parity_scenario_passes_and_reports(shared_run: SharedRun) -> None:
    p, out = shared_run(str(REPO / "scenarios" / "text_parity.toml"))  # tests/test_cluster.py reads it too
    assert p.returncode == 0, p.stdout + p.stderr
    for header in ("Run", "World size", "Per-rank batch", "Runtime", "Post-step-1 median tok/s", "Avg loss",
                   "Final loss", "Final-loss delta vs single", "Peak MLX MB per rank"):
        assert header in p.stdout
    doc = json.loads((out / "result.json").read_text())
    assert doc["passed"] and doc["exit_code"] == 0 and doc["schema_version"] == 2
    assert re.search(r"[\[{]'|\[\d", p.stdout) is None, "a Python list or dict repr in the tables"
    tail = p.stdout.strip().splitlines()[-2:]  # the run ends on its summary, not on the last table
    assert tail[0].startswith("summary: 1 scenario: 1 passed, 0 failed, 0 with a run that did not complete; checks: ")
    assert tail[0].endswith("exit 0") and tail[1] == f"report: {out / 'report.md'}"
    assert {"mlx_version", "device", "default_backend", "platform", "python", "blas"} <= doc["environment"].keys()
    (s,) = doc["scenarios"]
    runs = {r["name"]: r for r in s["runs"]}
    assert [runs[n]["world_size"] for n in ("single", "ddp2", "ddp4")] == [1, 2, 4]
    for r in runs.values():
        assert len(r["losses"]) == 20 and len(r["ranks"]) == r["world_size"]
        assert all(rk["host"] and rk["pid"] and rk["rss_peak_bytes"] > 0 for rk in r["ranks"])
        assert r["losses"][-1] < r["losses"][0] - 1.0  # the model learns
    names = {(c["name"], c["run"]) for c in s["checks"]}
    for run in ("ddp2", "ddp4"):
        assert {("loss_parity", run), ("param_parity", run), ("replica_consistency", run),
                ("memory_rss_per_rank_mb", run), ("memory_mlx_total_mb", run)} <= names
    for c in s["checks"]:
        if c["run"] == "single" and c["name"] in ("replica_consistency", "ranks_agree"):  # one rank: nothing to compare
            assert c["result"] == "n/a" and c["value"] is None, c
            continue
        assert c["passed"] and c["limit"] is not None and c["value"] is not None
        if c["name"] == "loss_parity":
            assert c["value"] <= 1e-5
    for run in ("ddp2", "ddp4"):  # eval and data share (seed 003's memory criterion)
        assert {("eval_parity", run), ("data_share_bytes", run), ("ranks_agree", run),
                ("rank0_side_effects", run), ("global_rng_untouched", run)} <= names
    held = {n: max(d["bytes_held"] for d in runs[n]["data"]) for n in runs}
    assert held["single"] > 1.8 * held["ddp2"] > 1.8 * 1.8 * held["ddp4"]
    pads = [d["eval_pad_rows_local"] for d in runs["ddp4"]["data"]]
    assert pads == [0, 1, 1, 1]  # 29 eval rows over 4 ranks: short ranks pad with zero-token rows
    assert [e["step"] for e in runs["ddp4"]["evals"]] == [10, 20] and runs["ddp4"]["evals"][0]["tokens"] > 0
    assert runs["ddp4"]["evals"] == [dict(e) for e in runs["ddp4"]["evals"]]
    assert all(e["loss"] == e["loss"] for e in runs["ddp4"]["evals"])  # not NaN
    lrs = runs["ddp2"]["learning_rates"]  # warmup over 2 steps, then cosine decay to 0.1 x 3e-3
    assert lrs[0] < lrs[1] and max(lrs) == pytest.approx(3e-3) and lrs[-1] < lrs[5] < max(lrs)
    assert lrs == runs["single"]["learning_rates"] and max(runs["ddp2"]["grad_norms"]) > 0
    report = (out / "report.md").read_text()
    assert "| ddp4 " in report and "loss_parity" in report
    assert (out / "runs" / "text_parity" / "ddp4" / "rank3.events.jsonl").exists()


@pytest.mark.ranks
def test_memory_ceiling_breach_exits_1(scenario_dir: Path) -> None:
    path = write_scenario(scenario_dir, "tight", checks="max_rss_mb = 1\nmax_total_mlx_mb = 1000")
    p = cli("run", str(path), "--format", "github")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "tight: FAILED" in p.stdout
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in p.stdout.splitlines() if ln.startswith("| memory")]
    rss = [r for r in rows if r[0] == "memory_rss_per_rank_mb"]
    # Check | Run | Value | Floor | Ratio | Limit | Result
    assert [(r[1], r[5], r[6]) for r in rss] == [("single", "1", "FAIL"), ("ddp2", "1", "FAIL")]
    assert all(float(r[2]) > 1 for r in rss)
    assert any(ln.startswith("| loss_parity") and "| pass" in ln for ln in p.stdout.splitlines())


@pytest.mark.ranks
def test_rank_crash_exits_3_naming_rank(scenario_dir: Path, tmp_path: Path) -> None:
    fault = '\n[[faults]]\nrank = 1\nstep = 2\naction = "raise"\n'
    path = write_scenario(scenario_dir, "crash", world_sizes=(2,), extra=fault)
    p = cli("run", str(path), "--out", str(tmp_path / "o"))
    assert p.returncode == 3, p.stdout + p.stderr
    cause = "rank 1 failed while running a training step at step 2: RuntimeError: injected error in the model's"
    assert cause in p.stdout
    assert "rank 0: a peer rank failed: rank 1 failed while running a training step at step 2" in p.stdout
    assert p.stdout.index(cause) < p.stdout.index("rank 0: a peer rank failed")  # the cause comes first
    doc = json.loads((tmp_path / "o" / "result.json").read_text())
    assert doc["exit_code"] == 3 and doc["scenarios"][0]["status"] == "error"


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda d: d / "missing.toml", "missing.toml: scenario file not found"),
        (lambda d: (d / "bad.toml").write_text("[scenario]\nname = \n") and d / "bad.toml", "malformed TOML"),
        (lambda d: write_scenario(d, "ws", world_sizes=(1, 9)), "[[runs]][1].world_size: 9 exceeds"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_keeps_old_outputs(
    scenario_dir: Path, tmp_path: Path, make, needle: str  # noqa: ANN001
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "result.json").write_text("previous")
    p = cli("run", str(make(scenario_dir)), "--out", str(out))
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and needle in p.stderr and p.stderr.startswith("error: ")
    assert (out / "result.json").read_text() == "previous"


def test_kept_checkpoints_resume_from_their_path_and_a_damaged_one_is_bad_input(
    scenario_dir: Path, tmp_path: Path
) -> None:
    first = write_scenario(scenario_dir, "makes", world_sizes=(2,),
                           extra='\n[[runs]]\nname = "part"\nworld_size = 2\nstop_after = 2\n')
    out = tmp_path / "out"
    p = cli("run", str(first), "--out", str(out), "--keep-checkpoints")
    assert p.returncode == 0, p.stdout + p.stderr
    kept = out / "runs" / "makes" / "part" / "checkpoints"
    assert sorted(f.name for f in (kept / "step-00000002").iterdir()) == [
        "manifest.json", "model.safetensors", "optimizer.safetensors", "trainer.json"]
    later = write_scenario(scenario_dir, "continues", world_sizes=(1,),
                           extra=f'\n[[runs]]\nname = "resumed"\nworld_size = 2\nresume_from = "{kept}"\n'
                                 f'expect_resume_step = 2\n')
    p = cli("run", str(later))
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"{kept} @ step 2" in p.stdout  # the resume table's row
    damaged = kept / "step-00000002" / "model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:100])
    p = cli("run", str(later), "--out", str(out))
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"error: {later}: [[runs]][1].resume_from: {damaged}: 100 bytes, the manifest says")
    assert json.loads((out / "result.json").read_text())["passed"]  # the earlier result is untouched
    p = cli("run", str(first), "--keep-checkpoints")
    assert p.returncode == 2 and "--keep-checkpoints needs --out" in p.stderr


def test_run_without_argument_takes_the_default_set(tmp_path: Path) -> None:
    d = tmp_path / "scenarios"
    d.mkdir()
    write_scenario(d, "other")
    p = cli("run", cwd=tmp_path)
    assert p.returncode == 2 and "no scenario with default = true" in p.stderr
    path = write_scenario(d, "chosen", world_sizes=(1,), steps=2)
    path.write_text(path.read_text().replace("seed = 7", "seed = 7\ndefault = true"))
    p = cli("run", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "chosen: PASSED" in p.stdout and not any(ln.startswith("other:") for ln in p.stdout.splitlines())
    assert f"{d}: run only when named: other.toml" in p.stderr
    assert not p.stdout.splitlines()[-1].startswith("ran the default set")
    other = d / "other.toml"
    other.write_text(other.read_text().replace("seed = 7", "seed = 7\nfull = true"))
    p = cli("run", cwd=tmp_path)
    assert p.stdout.splitlines()[-1] == "ran the default set: 1 of the 2 scenarios of the full set; --all runs them all"
    p = cli("run", "--all", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "chosen: PASSED" in p.stdout and "other: PASSED" in p.stdout and "ran the default set" not in p.stdout
    assert "no ./scenarios here" not in p.stderr


def test_bare_run_outside_a_checkout_says_which_suite_it_takes(tmp_path: Path) -> None:
    from harness.present.cli import resolve_scenarios

    notes: list[str] = []
    here = Path.cwd()
    try:
        os.chdir(tmp_path)  # no ./scenarios: the shipped suite, said so
        found = resolve_scenarios([], notes)
    finally:
        os.chdir(here)
    assert found and all(s.default for s in found)
    assert notes[0] == f"no ./scenarios here: running the harness's own default suite ({REPO / 'scenarios'})"
    assert notes[1].startswith(f"{REPO / 'scenarios'}: not in the default set (--all runs the full set): ")
    assert notes[2].startswith(f"{REPO / 'scenarios'}: run only when named: ")


def test_list_and_doctor() -> None:
    p = cli("list")
    assert p.returncode == 0 and "text_parity" in p.stdout and "1, 2, 4" in p.stdout
    p = cli("doctor")
    assert p.returncode == 0, p.stdout + p.stderr
    for what in ("mlx version", "distributed backends", "loopback ports", "BLAS"):
        assert what in p.stdout
    assert "ring" in p.stdout
    # probed from MLX on two ranks: ring has every collective but sum_scatter (MLX 0.32.4)
    assert "collectives (ring)" in p.stdout and "all but sum_scatter (RuntimeError: [ring] sum_scatter" in p.stdout


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "mlx-ddp-harness"
    found = str(script) if script.exists() else shutil.which("mlx-ddp-harness")
    assert found, "the mlx-ddp-harness console script is not installed"
    p = subprocess.run([found, "list"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.returncode == 0 and "text_parity" in p.stdout


@pytest.mark.ranks
def test_repeats_show_their_median_and_range_in_the_run_table(tmp_path: Path) -> None:
    """``run --repeat 2``: the run table's speed figures are the median of the repeats with their
    range, its headers say so, and result.json keeps the first repeat's figures beside them."""
    import statistics

    out = tmp_path / "out"
    p = cli("run", "examples/minimal_parity.toml", "--repeat", "2", "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    report = (out / "report.md").read_text()
    for text in (p.stdout, report):
        assert "Post-step-1 median tok/s (median of 2 repeats, min-max)" in text
        assert "Runtime (median of 2 repeats, min-max)" in text
        assert "DDP parity at equal global batch; trainer: reference; fine-tune: full" in text
    (s,) = json.loads((out / "result.json").read_text())["scenarios"]
    for r in s["runs"]:
        tok_s = [x["median_tok_s"] for x in r["repeats"]]
        assert r["median_tok_s"] == tok_s[0] and (r["trainer"], r["fine_tune"]) == ("reference", "full")
        assert r["over_repeats"]["median_tok_s"] == {"median": statistics.median(tok_s), "min": min(tok_s),
                                                     "max": max(tok_s), "n": 2}
        lo, hi = f"{min(tok_s):.1f}", f"{max(tok_s):.1f}"
        cell = f"{statistics.median(tok_s):.1f}" + (f" ({lo}-{hi})" if lo != hi else "")
        row = next(ln for ln in p.stdout.splitlines() if f"  {r['name']}{' (floor)' if r['floor'] else ''}  " in ln)
        assert f"  {cell}  " in row or f"  {cell} *  " in row, row


@pytest.mark.ranks
def test_report_renders_saved_results_without_running(tmp_path: Path) -> None:
    out = tmp_path / "out"
    p = cli("run", str(write_scenario(tmp_path, "saved", world_sizes=(1,), steps=2)), "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    shutil.rmtree(out / "runs")  # nothing but result.json is needed
    r = cli("report", str(out))
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.startswith(f"{out / 'result.json'}: PASSED") and p.stdout.strip() in r.stdout
    g = cli("report", str(out / "result.json"), "--format", "github")
    assert g.returncode == 0 and "| single " in g.stdout and "|--" in g.stdout


def test_report_refuses_bad_results_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "old.json").write_text(json.dumps({"schema_version": 1, "scenarios": []}))
    for target, text in ((tmp_path / "missing", "not found"), (tmp_path / "broken.json", "unreadable"),
                         (tmp_path / "old.json", "schema_version 1, expected 2")):
        r = cli("report", str(target))
        assert r.returncode == 2 and r.stdout == "", r.stderr
        assert r.stderr.startswith(f"error: {target}") and text in r.stderr and r.stderr.count("\n") == 1


def test_help_states_the_exit_codes_in_plain_text() -> None:
    for args in ((), ("run",), ("report",), ("gate",), ("list",), ("doctor",), ("baseline",), ("new",)):
        p = cli(*args, "--help")
        assert p.returncode == 0, p.stderr
        assert "``" not in p.stdout, (args, p.stdout)  # no reStructuredText markup
    for args in ((), ("run",)):
        text = cli(*args, "--help").stdout
        assert "exit codes of run:" in text and "3  a run did not complete" in text and "docs/commands.md" in text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the mlx-cpu wheel's bundled BLAS is Linux's")
def test_a_run_on_the_slow_bundled_blas_says_so_first_with_the_fix(tmp_path: Path) -> None:
    path = write_scenario(tmp_path, "blas", world_sizes=(1,), steps=2)
    p = cli("run", str(path), "--progress", "off", env={"MLX_DDP_HARNESS_BLAS": "bundled"})
    assert p.returncode == 0, p.stdout + p.stderr
    first = p.stderr.splitlines()[0]
    assert first.startswith("note: ranks will use the bundled reference BLAS (") and \
        "unset MLX_DDP_HARNESS_BLAS" in first, first
    quiet = cli("run", str(path), "--progress", "off", env={"MLX_DDP_HARNESS_BLAS": ""})
    from harness.controller.environment import blas_info

    if not blas_info()["slow"]:  # OpenBLAS is here: nothing to say
        assert not any(ln.startswith("note: ranks will use") for ln in quiet.stderr.splitlines())


def test_a_fault_in_the_harness_exits_5_with_its_traceback_never_1(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """An exception no command expects (a bug, such as an overflow in a statistic) exits 5 with its
    traceback and one line saying it is the harness's fault: exit 1 means a check failed."""
    from harness.exit_codes import EXIT_INTERNAL
    from harness.present import cli as cli_module

    def broken(args: object) -> int:
        raise OverflowError("math range error")

    monkeypatch.setattr(cli_module, "cmd_list", broken)
    assert cli_module.main(["list"]) == EXIT_INTERNAL == 5
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1] == (
        "internal error: OverflowError: math range error (a fault in mlx-ddp-harness, not a verdict)")


def test_a_fault_while_loading_the_command_line_exits_5_too(tmp_path: Path) -> None:
    """A dependency that breaks on import (here a psutil that raises) is a fault in the harness
    too, under ``python -m harness`` and the installed command alike: 5, never 1."""
    (tmp_path / "psutil.py").write_text('raise RuntimeError("psutil broken on purpose")\n')
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), str(REPO), os.environ.get("PYTHONPATH")]))}
    script = shutil.which("mlx-ddp-harness", path=str(Path(sys.executable).parent))
    commands = [[sys.executable, "-m", "harness", "list"], *([[script, "list"]] if script else [])]
    for command in commands:
        p = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120,
                           env={**os.environ, **env})
        assert p.returncode == 5, (command, p.stderr[-2000:])
        assert "Traceback" in p.stderr and p.stderr.rstrip().splitlines()[-1] == (
            "internal error while loading the command line: RuntimeError: psutil broken on purpose "
            "(a fault in mlx-ddp-harness, not a verdict)")
    assert cli("list").returncode == 0  # the same command with psutil as installed


def test_the_command_line_is_loaded_under_the_guard_by_both_entry_points(monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The installed command and ``python -m harness`` both enter through ``harness.present.command``,
    which turns a command line that cannot be imported into exit 5."""
    import tomllib

    import harness.present
    from harness.present import command

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"mlx-ddp-harness": "harness.present.command:main"}
    assert "from harness.present.command import main" in (REPO / "harness" / "__main__.py").read_text()
    monkeypatch.delattr(harness.present, "cli", raising=False)
    monkeypatch.setitem(sys.modules, "harness.present.cli", None)  # importing it raises ModuleNotFoundError
    assert command.main(["list"]) == 5
    assert capsys.readouterr().err.rstrip().splitlines()[-1].startswith(
        "internal error while loading the command line: ModuleNotFoundError: import of harness.present.cli halted")


def test_a_gate_side_whose_run_faulted_exits_5_and_one_that_failed_exits_2(monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A side's run that exited 5 (a fault in the harness) is passed on as 5; any other side that
    gave no result is the one-line error of bad input (2)."""
    from harness.present import cli as cli_module
    from harness.run.pairs import SideError

    for internal, code in ((True, 5), (False, 2)):
        def side(args: object, internal: bool = internal) -> int:
            raise SideError("candidate", "the candidate side's run exited 5: see its log", internal=internal)

        monkeypatch.setattr(cli_module, "cmd_list", side)
        assert cli_module.main(["list"]) == code
        assert capsys.readouterr().err == "error: the candidate side's run exited 5: see its log\n"
