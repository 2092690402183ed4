"""Batch widths: the reference trainer pads each micro-batch's inputs to a multiple of ``pad_to``
(masked, so the results do not change), every run reports the widths it trained at, and the
throughput table shows them and warns about widths a device is known to train slowly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.data.sources import Example
from harness.data.tokenizers import ByteTokenizer
from harness.present.shapes import width_cell, width_warnings
from harness.present.tables import runs_table, scenario_text
from harness.run.results import step_widths
from harness.trainers.reference.batching import collate
from tests.conftest import cli, write_scenario

TOK = ByteTokenizer()


def _ex(n: int) -> Example:
    import numpy as np

    return Example(np.arange(1, n + 1, dtype=np.int32), np.ones(n, dtype=np.int8))


def test_collate_pads_the_width_to_a_multiple_and_masks_the_padding() -> None:
    plain = collate([_ex(20), _ex(9)], TOK.pad_id)
    padded = collate([_ex(20), _ex(9)], TOK.pad_id, pad_to=32)
    assert plain.inputs.shape == (2, 19) and padded.inputs.shape == (2, 32)
    assert (padded.inputs[:, :19] == plain.inputs).all() and (padded.inputs[:, 19:] == TOK.pad_id).all()
    assert padded.mask[:, 19:].sum() == 0 and padded.tokens == plain.tokens == 19 + 8
    assert collate([_ex(33)], TOK.pad_id, pad_to=32).inputs.shape == (1, 32)  # already a multiple
    assert collate([_ex(34)], TOK.pad_id, pad_to=32).inputs.shape == (1, 64)


def test_widths_cells_and_slow_width_warnings() -> None:
    assert step_widths([[32, 64, None], [64, 32, None]]) == [64, 64]
    assert step_widths([[32], []]) == [] and step_widths([[]]) == []
    run = {"name": "r", "input_widths": [1023, 1023], "accelerator": "cuda"}
    assert width_cell(run) == "1023" and width_cell({**run, "input_widths": [96, 160, 128]}) == "96-160"
    assert width_cell({"name": "x"}) == "-"
    (line,) = width_warnings({"runs": [run]})
    assert line.startswith("run r: input widths 1023 are not multiples of 32; on cuda") and "pad_to = 32" in line
    assert width_warnings({"runs": [{**run, "input_widths": [1024]}]}) == []
    assert width_warnings({"runs": [{**run, "accelerator": "cpu"}]}) == []  # measured on CUDA only


def test_the_throughput_table_shows_padded_widths_and_warns_on_cuda() -> None:
    runs = [{"name": n, "world_size": 1, "per_rank_batch": "8", "global_batch": 8, "ok": True, "runtime_s": 1.0,
             "median_tok_s": 10.0, "avg_loss": 3.0, "final_loss": 2.0, "tokens_global": 80, "mlx_peak_bytes": [],
             "rss_peak_bytes": [], "input_widths": w, "accelerator": "cuda"} for n, w in (("odd", [1023]),
                                                                                         ("aligned", [1024]))]
    scenario = {"name": "t", "status": "passed", "kind": "throughput", "reference": "aligned", "runs": runs,
                "checks": []}
    header, _, odd, aligned = runs_table(scenario, "github").splitlines()
    assert "Padded width" in header and "| 1023 " in odd and "| 1024 " in aligned
    text = scenario_text(scenario)
    assert "run odd: input widths 1023 are not multiples of 32" in text and "run aligned:" not in text


@pytest.mark.ranks
def test_padding_is_masked_and_runs_report_their_widths(tmp_path: Path) -> None:
    """A 2-rank run padding to the longest row only matches one process padding to 32, and the
    result names each run's widths."""
    extra = '\n[[runs]]\nname = "longest2"\nworld_size = 2\ntrain = { pad_to = 1 }\n'
    path = write_scenario(tmp_path, "padding", steps=3, extra=extra)
    p = cli("run", str(path), "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    (s,) = json.loads((tmp_path / "out" / "result.json").read_text())["scenarios"]
    runs = {r["name"]: r for r in s["runs"]}
    assert all(w % 32 == 0 for w in runs["single"]["input_widths"] + runs["ddp2"]["input_widths"])
    assert len(runs["single"]["input_widths"]) == 3 and runs["single"]["accelerator"] == "cpu"
    assert any(w % 32 for w in runs["longest2"]["input_widths"])
    parity = {c["name"]: c for c in s["checks"] if c["run"] == "longest2"}
    assert parity["step_loss_parity"]["passed"] and parity["loss_parity"]["passed"] and parity["param_parity"]["passed"]


def test_gradient_norms_are_recorded_in_parity_and_left_out_of_throughput_scenarios(tmp_path: Path) -> None:
    from harness.scenario import load_scenario

    parity = load_scenario(write_scenario(tmp_path, "parity"))
    assert parity.for_run(parity.runs[0]).train.grad_norms == "on"
    speed = write_scenario(tmp_path, "speed")
    speed.write_text(speed.read_text().replace("seed = 7\n", 'seed = 7\nkind = "throughput"\n', 1)
                     .replace("digest_every = 2\n", 'digest_every = 2\ngrad_norms = "on"\n', 1))
    s = load_scenario(speed)
    assert s.for_run(s.runs[0]).train.grad_norms == "on"  # asked for
    speed.write_text(speed.read_text().replace('grad_norms = "on"\n', ""))
    s = load_scenario(speed)
    assert s.for_run(s.runs[0]).train.grad_norms == "off"


@pytest.mark.ranks
def test_a_throughput_run_records_no_gradient_norms(tmp_path: Path) -> None:
    path = write_scenario(tmp_path, "speed", world_sizes=(1,), steps=3)
    path.write_text(path.read_text().replace("seed = 7\n", 'seed = 7\nkind = "throughput"\n', 1))
    p = cli("run", str(path), "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    (s,) = json.loads((tmp_path / "out" / "result.json").read_text())["scenarios"]
    assert s["runs"][0]["grad_norms"] == [None, None, None]
