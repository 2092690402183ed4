"""report.md, its plots, the job summary and the repeat table, from a result document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import schema
from harness.present.report import PLOTS_VAR, plots_wanted, write_outputs
from harness.present.tables import runs_table, scenario_text
from harness.run.results import merge_repeats
from tests.conftest import REPO

MB = 1024 * 1024
PNG = b"\x89PNG\r\n\x1a\n"


def _run(name: str, ws: int, tok_s: float, losses: list[float]) -> dict[str, Any]:
    return {"name": name, "world_size": ws, "per_rank_batch": str(8 // ws), "global_batch": 8, "ok": True,
            "runtime_s": 1.0, "median_tok_s": tok_s, "avg_loss": sum(losses) / len(losses), "final_loss": losses[-1],
            "losses": losses, "tokens_global": 900, "mlx_peak_bytes": [20 * MB // ws] * ws,
            "rss_peak_bytes": [100 * MB] * ws, "steps_start": 1}


def _scenario(status: str, tok_s: float, failed_check: bool = False) -> dict[str, Any]:
    check = {"name": "loss_parity", "run": "ddp2", "passed": not failed_check, "value": 1e-6, "limit": 1e-5,
             "detail": "vs single", "result": "FAIL" if failed_check else "pass"}
    return {"name": "demo", "description": "a demo", "kind": "parity", "model": "qwen3 0.10M / 160",
            "reference": "single", "status": status, "passed": status == "passed", "checks": [check],
            "runs": [_run("single", 1, tok_s, [3.0, 2.5, 2.2]), _run("ddp2", 2, tok_s / 2, [3.0, 2.5, 2.2])]}


def test_repeats_are_merged_and_their_spread_reported() -> None:
    merged = merge_repeats([_scenario("passed", 1000.0), _scenario("failed", 900.0, failed_check=True),
                            _scenario("passed", 1100.0)])
    assert merged["status"] == "failed" and merged["repeats"] == 3
    assert [c["run"] for c in merged["checks"]] == ["ddp2", "ddp2 (repeat 2)"]
    single = merged["runs"][0]
    assert [r["median_tok_s"] for r in single["repeats"]] == [1000.0, 900.0, 1100.0]
    text = scenario_text(merged)
    assert "Spread (stdev / median)" in text and "1000.0 / 900.0 / 1100.0" in text and "10.0%" in text


def test_report_md_has_the_tables_and_plots_and_goes_to_the_job_summary(tmp_path: Path, monkeypatch) -> None:
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    doc = schema.stamp({"passed": True, "exit_code": 0, "environment": {"cpu": "Test CPU"},
                        "scenarios": [merge_repeats([_scenario("passed", 1000.0), _scenario("passed", 1020.0)])]})
    written = write_outputs(tmp_path / "out", doc, plots=True)
    names = sorted(p.name for p in written)
    assert names == ["demo-delta.png", "demo-loss.png", "demo-memory.png", "demo-throughput.png", "report.md",
                     "result.json"]
    for p in written:
        if p.suffix == ".png":
            assert p.read_bytes().startswith(PNG) and p.stat().st_size > 5000
    report = (tmp_path / "out" / "report.md").read_text()
    for part in ("### DDP parity at equal global batch", "| Model / seq ", "### Repeat-to-repeat spread (2 repeats)",
                 "### Checks", "![demo: loss curves of every run overlaid](plots/demo-loss.png)",
                 "![demo: peak memory per rank](plots/demo-memory.png)",
                 "![demo: each run's loss delta from the reference per step, with its noise floor and limit]"
                 "(plots/demo-delta.png)"):
        assert part in report
    job = summary.read_text()
    assert job.startswith("earlier step\n# mlx-ddp-harness report") and "| Model / seq " in job and "![" not in job


def test_plots_are_left_out_when_the_environment_or_the_command_says_so(tmp_path: Path, monkeypatch) -> None:
    doc = schema.stamp({"passed": True, "exit_code": 0, "environment": {"cpu": "Test CPU"},
                        "scenarios": [merge_repeats([_scenario("passed", 1000.0)])]})
    monkeypatch.setenv(PLOTS_VAR, "off")
    assert not plots_wanted()
    assert sorted(p.name for p in write_outputs(tmp_path / "off", doc)) == ["report.md", "result.json"]
    assert "![" not in (tmp_path / "off" / "report.md").read_text() and not (tmp_path / "off" / "plots").exists()
    assert len(write_outputs(tmp_path / "asked", doc, plots=True)) == 6  # the command's --plots wins
    monkeypatch.setenv(PLOTS_VAR, "on")
    assert plots_wanted() and write_outputs(tmp_path / "no", doc, plots=False) == [tmp_path / "no" / "result.json",
                                                                                  tmp_path / "no" / "report.md"]


def _gfm_tables(markdown: str) -> list[list[list[str]]]:
    """Every table GitHub would render from ``markdown``: rows of cell texts, the header first."""
    from markdown_it import MarkdownIt

    tables, row, cell = [], None, None
    for tok in MarkdownIt("commonmark").enable("table").parse(markdown):
        if tok.type == "table_open":
            tables.append([])
        elif tok.type == "tr_open":
            row = []
        elif tok.type in ("th_open", "td_open"):
            cell = ""
        elif tok.type == "inline" and cell is not None:
            cell = tok.content
        elif tok.type in ("th_close", "td_close"):
            row.append(cell)
            cell = None
        elif tok.type == "tr_close":
            tables[-1].append(row)
    return tables


def test_report_md_renders_as_gfm_with_every_column_intact(tmp_path: Path) -> None:
    """Cells that hold ``|`` (a norm, an absolute value) stay one cell when GitHub renders them."""
    scenario = _scenario("passed", 1000.0)
    detail = "||g - g_ref|| / ||g_ref||; largest |delta| 3e-7"
    scenario["checks"].append({"name": "step_grad_parity", "run": "ddp2", "passed": True, "value": 2e-7,
                               "limit": 2e-6, "result": "pass", "detail": detail})
    doc = schema.stamp({"passed": True, "exit_code": 0, "environment": {"cpu": "Test CPU"}, "scenarios": [scenario]})
    write_outputs(tmp_path / "out", doc)
    tables = _gfm_tables((tmp_path / "out" / "report.md").read_text())
    assert len(tables) >= 2
    for t in tables:
        assert all(len(r) == len(t[0]) for r in t), t
    cells = [c for t in tables for r in t for c in r]
    assert detail in cells  # whole: a cut cell would have lost its tail to the next column
    # and GitHub splits a row at every unescaped |: each row has its header's count
    import re

    widths = [len(re.findall(r"(?<!\\)\|", ln)) if ln.startswith("|") else None
              for ln in (tmp_path / "out" / "report.md").read_text().splitlines()]
    for prev, width in zip(widths, widths[1:], strict=False):
        assert prev is None or width is None or prev == width


def test_output_to_a_pipe_closed_early_is_no_error(tmp_path: Path) -> None:
    """``mlx-ddp-harness report DIR | head``: the reader leaves after a line; no traceback, exit 0."""
    import subprocess
    import sys

    scenario = _scenario("passed", 1000.0)
    scenario["checks"] = scenario["checks"] * 3000  # far more than a pipe's buffer
    doc = schema.stamp({"passed": True, "exit_code": 0, "environment": {"cpu": "Test CPU"}, "scenarios": [scenario]})
    schema.write_json_atomic(tmp_path / "result.json", doc)
    p = subprocess.Popen([sys.executable, "-m", "harness", "report", str(tmp_path / "result.json")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline()
    p.stdout.close()  # as head does after its lines
    err = p.stderr.read().decode() if p.stderr else ""
    assert p.wait(timeout=60) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_speed_measured_beside_other_work_is_marked_and_a_queue_wait_said() -> None:
    s = _scenario("passed", 1000.0)
    single, ddp2 = s["runs"]
    single["cpu_use"] = {"cores": 2, "wall_s": 10.0, "busy_s": 20.0, "own_s": 10.0}  # others: 1 core; 1 left free
    ddp2["cpu_use"] = {"cores": 2, "wall_s": 10.0, "busy_s": 25.0, "own_s": 20.0}  # others: 0.5; none left free
    ddp2["queued_s"] = 11.04
    text = scenario_text(s)
    assert "1000.0 *" not in text and "500.0 *" in text  # single's others fit in the core it left free
    assert ("* run ddp2: measured while other processes kept 0.50 of 2 CPUs busy (its 2 ranks left 0 free): its "
            "speed is not comparable with a quiet run's") in text
    assert "run ddp2 waited 11.0 s for this machine's rank slots before it started (other launches held them)" in text
    ddp2["cpu_use"], ddp2["queued_s"] = {"cores": 2, "wall_s": 10.0, "busy_s": 21.0, "own_s": 20.0}, 0.2
    quiet = scenario_text(s)  # 0.1 of a core: within the slack
    assert "*" not in quiet and "waited" not in quiet
    ddp2["neighbours"] = {"samples": 10, "shared": 9, "most": 6}  # other launches beside it, 90% of the run
    assert "*" not in scenario_text(s)  # on the CPU the rank budget keeps them within the cores
    ddp2["ranks"] = [{"rank": r, "accelerator": "cuda"} for r in range(2)]
    assert ("* run ddp2: measured while on the cuda GPU other launches held rank slots for 90% of it (up to 6 at "
            "once): its speed is not comparable with a quiet run's") in scenario_text(s)
    ddp2["neighbours"] = {"samples": 10, "shared": 5, "most": 6}  # half of it: its fastest steps were alone
    assert "*" not in scenario_text(s)


def _cells(text: str, run: str) -> list[str]:
    """The cells of ``run``'s row in a GitHub table (the header row when ``run`` is ``""``)."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and (cells[1] == run if run else cells[0] == "Model / seq"):
            return cells
    raise AssertionError(f"no row {run!r} in\n{text}")


def _row(text: str, run: str) -> dict[str, str]:
    """``run``'s row of a GitHub table, by header."""
    return dict(zip(_cells(text, ""), _cells(text, run), strict=True))


def _repeat(tok_s: float, runtime: float, losses: list[float] | None = None) -> dict[str, Any]:
    s = _scenario("passed", tok_s)
    for r in s["runs"]:
        r["runtime_s"] = runtime / r["world_size"]
        r["trainer"], r["fine_tune"], r["lora"] = "reference", "full", None
        if losses:
            r.update(losses=losses, avg_loss=sum(losses) / len(losses), final_loss=losses[-1])
    s["runs"][1]["final_loss_delta"] = 0.0
    return s


def test_over_repeats_the_run_table_shows_the_median_and_range_and_says_so() -> None:
    merged = merge_repeats([_repeat(1000.0, 2.0), _repeat(900.0, 2.4), _repeat(1300.0, 1.8)])
    single, ddp2 = merged["runs"]
    assert single["median_tok_s"] == 1000.0  # result.json keeps the first repeat's figures
    assert single["over_repeats"]["median_tok_s"] == {"median": 1000.0, "min": 900.0, "max": 1300.0, "n": 3}
    assert ddp2["over_repeats"]["runtime_s"] == {"median": 1.0, "min": 0.9, "max": 1.2, "n": 3}
    text = runs_table(merged, "github")
    header = _cells(text, "")
    assert "Post-step-1 median tok/s (median of 3 repeats, min-max)" in header
    assert "Runtime (median of 3 repeats, min-max)" in header
    assert "Avg loss" in header and "Final loss" in header  # the same in every repeat: shown once, as they are
    row = _row(text, "single")
    assert row["Post-step-1 median tok/s (median of 3 repeats, min-max)"] == "1000.0 (900.0-1300.0)"
    assert row["Runtime (median of 3 repeats, min-max)"] == "2.000s (1.800-2.400s)"
    assert row["Final loss"] == "2.200000"
    row = _row(text, "ddp2")
    assert row["Post-step-1 median tok/s (median of 3 repeats, min-max)"] == "500.0 (450.0-650.0)"
    # losses that moved between repeats are shown as their median and range too
    moved = merge_repeats([_repeat(1000.0, 2.0), _repeat(1000.0, 2.0, [3.0, 2.5, 2.4]), _repeat(1000.0, 2.0)])
    text = runs_table(moved, "github")
    row = _row(text, "single")
    assert row["Final loss (median of 3 repeats, min-max)"] == "2.200000 (2.200000-2.400000)"
    assert row["Post-step-1 median tok/s (median of 3 repeats, min-max)"] == "1000.0"  # no spread: one value
    # a repeat that did not complete is counted out, and the cell says so
    broken = _repeat(700.0, 2.0)
    broken["runs"][0].update(ok=False, failure="killed")
    text = runs_table(merge_repeats([_repeat(1000.0, 2.0), broken, _repeat(1200.0, 2.0)]), "github")
    row = _row(text, "single")
    assert row["Post-step-1 median tok/s (median of 3 repeats, min-max)"] == "1100.0 (1000.0-1200.0; 2 of 3 repeats)"
    assert "median of" not in runs_table(_repeat(1000.0, 2.0))  # one run: its own figures, no claim


def test_the_report_md_run_table_shows_the_same_medians(tmp_path: Path) -> None:
    from harness.present.report import markdown

    merged = merge_repeats([_repeat(1000.0, 2.0), _repeat(900.0, 2.4)])
    doc = schema.stamp({"passed": True, "exit_code": 0, "environment": {"cpu": "Test CPU"}, "scenarios": [merged]})
    report = markdown(doc)
    assert "### DDP parity at equal global batch; trainer: reference; fine-tune: full" in report
    (table,) = [t for t in _gfm_tables(report) if t[0][0] == "Model / seq"]
    row = dict(zip(table[0], table[1], strict=True))
    assert row["Post-step-1 median tok/s (median of 2 repeats, min-max)"] == "950.0 (900.0-1000.0)"
    assert row["Runtime (median of 2 repeats, min-max)"] == "2.200s (2.000-2.400s)"


def _throughput(ref_tok_s: float, lora_tok_s: float, lora_trainer: str = "reference") -> dict[str, Any]:
    """A throughput scenario: ``full`` (the reference run, full fine-tuning) and ``lora`` (LoRA, rank 8),
    their fine-tune figures as ``run_summary`` records them from ``scenarios/mlx_lm_lora.toml``'s trainer."""
    from harness.run.results import fine_tune
    from harness.scenario import load_scenario
    from harness.scenario.trainers import trainer_info

    s = load_scenario(REPO / "scenarios" / "mlx_lm_lora.toml")
    lora_trainer_spec = s.for_run(s.runs[0]).trainer
    info = trainer_info(lora_trainer_spec.kind)
    full = dict(_run("full", 1, ref_tok_s, [3.0, 2.5]), trainer="reference", fine_tune="full", lora=None)
    lora = dict(_run("lora", 1, lora_tok_s, [3.0, 2.6]), trainer=lora_trainer, **fine_tune(lora_trainer_spec, info))
    return {"name": "speed", "description": "", "kind": "throughput", "model": "llama 0.10M / 160",
            "reference": "full", "status": "passed", "passed": True, "checks": [], "runs": [full, lora]}


def test_the_trainer_and_fine_tune_are_shown_and_speed_never_compares_lora_with_full_silently() -> None:
    from harness.present.tables import runs_title

    s = _throughput(1000.0, 1470.0)
    assert s["runs"][1]["fine_tune"] == "lora" and s["runs"][1]["lora"]["rank"] == 8
    text = runs_table(s, "github")
    header = _cells(text, "")
    assert header[1:4] == ["Run", "Trainer", "Fine-tune"]  # the runs differ: a column each
    full, lora = _row(text, "full"), _row(text, "lora")
    assert (full["Trainer"], full["Fine-tune"], lora["Trainer"], lora["Fine-tune"]) == \
        ("reference", "full", "reference", "lora r=8")
    assert full["Speed vs full"] == "1.00x"
    assert lora["Speed vs full"] == "1.47x (lora r=8 vs full)"
    other = _row(runs_table(_throughput(1000.0, 800.0, "mlx_lm"), "github"), "lora")
    assert other["Speed vs full"] == "0.80x (mlx_lm vs reference; lora r=8 vs full)"
    # over repeats: the median of each repeat's ratio to the reference run of the same repeat
    merged = merge_repeats([_throughput(1000.0, 1470.0), _throughput(1100.0, 1320.0), _throughput(900.0, 1440.0)])
    assert merged["runs"][1]["over_repeats"]["speed_vs_reference"]["median"] == 1.47
    text = runs_table(merged, "github")
    lora = _row(text, "lora")
    assert lora["Speed vs full (median of 3 repeats, min-max)"] == "1.47x (1.20-1.60x; lora r=8 vs full)"
    # one trainer and fine-tune for every run: named once, in the title, not in columns
    same = _throughput(1000.0, 1100.0)
    same["runs"][1].update(fine_tune="full", lora=None)
    text = runs_table(same, "github")
    assert "Trainer" not in text and _row(text, "lora")["Speed vs full"] == "1.10x"
    assert runs_title(same).endswith("; trainer: reference; fine-tune: full")
    text = scenario_text(same)
    assert text.splitlines()[2].endswith("; trainer: reference; fine-tune: full")  # above the table it names
    assert runs_title(_throughput(1000.0, 1100.0)).endswith("not a parity test)")
    script = _throughput(1000.0, 1100.0)
    script["runs"][1].update(trainer="script", fine_tune=None, lora=None)  # a script fine-tunes as its code does
    lora = _row(runs_table(script, "github"), "lora")
    assert lora["Fine-tune"] == "set by the script" and lora["Speed vs full"] == "1.10x (script vs reference)"
