"""Scenario parsing: valid files load; every bad input names the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.scenario import Scenario, ScenarioError, load_scenario
from tests.conftest import REPO, write_scenario


def test_shipped_text_parity_scenario_loads() -> None:
    s = load_scenario(REPO / "scenarios" / "text_parity.toml")
    assert [r.world_size for r in s.runs] == [1, 2, 4]
    assert s.train.steps == 20 and s.default
    assert s.checks.reference == "single" and s.checks.loss_tolerance is None


def test_round_trips_through_job_dict(scenario_dir: Path) -> None:
    s = load_scenario(write_scenario(scenario_dir, "rt"))
    assert Scenario.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(
    ("patch", "expected_key"),
    [
        (("steps = 4", "steps = 0"), "[train].steps"),
        (("steps = 4", 'steps = "four"'), "[train].steps"),
        (("rows = 21", "rowz = 21"), "[data].rowz"),
        (('arch = "qwen3"', 'arch = "gpt9"'), "[model].arch"),
        (('reference = "single"', 'reference = "nope"'), "[checks].reference"),
        (("world_size = 2", "world_size = 0"), "[[runs]][1].world_size"),
        (("world_size = 2", "world_size = 7"), "[[runs]][1].world_size"),
        (("seed = 7", "seed = -1"), "[scenario].seed"),
        (("[limits]", "[limitz]"), "[limitz]"),
        (("seed = 7", 'seed = 7\nkind = "speed"'), "[scenario].kind"),
        (("world_size = 2", "world_size = 2\ntrain = { global_batch = 12 }"), "[[runs]][1].train.global_batch"),
        (("seed = 7", 'seed = 7\nkind = "throughput"', 'reference = "single"', ""), "[checks].reference"),
    ],
)
def test_bad_key_names_file_and_key(scenario_dir: Path, patch: tuple[str, ...], expected_key: str) -> None:
    path = write_scenario(scenario_dir, "bad")
    text = path.read_text()
    for old, new in zip(patch[::2], patch[1::2], strict=True):
        text = text.replace(old, new, 1)
    path.write_text(text)
    with pytest.raises(ScenarioError) as e:
        load_scenario(path)
    msg = str(e.value)
    assert str(path) in msg and expected_key in msg
    assert "\n" not in msg


def test_a_throughput_scenario_may_train_runs_at_other_global_batches(scenario_dir: Path) -> None:
    path = write_scenario(scenario_dir, "guide", extra="")
    text = path.read_text().replace("seed = 7", 'seed = 7\nkind = "throughput"', 1)
    path.write_text(text.replace("world_size = 2", "world_size = 2\ntrain = { global_batch = 12 }", 1))
    s = load_scenario(path)
    assert s.kind == "throughput" and s.for_run(s.run("ddp2")).train.global_batch == 12
    assert Scenario.from_dict(s.to_dict()) == s


def test_malformed_toml(scenario_dir: Path) -> None:
    path = scenario_dir / "broken.toml"
    path.write_text("[scenario\nname = 'x'\n")
    with pytest.raises(ScenarioError, match=r"broken\.toml: malformed TOML"):
        load_scenario(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="scenario file not found"):
        load_scenario(tmp_path / "nope.toml")


def test_missing_data_path_is_named(scenario_dir: Path) -> None:
    path = write_scenario(scenario_dir, "nodata")
    path.write_text(path.read_text().replace("rows = 21", 'rows = 21\nsource = "jsonl"\npath = "rows.jsonl"'))
    with pytest.raises(ScenarioError, match=r"\[data\]\.path: path does not exist: .*rows\.jsonl"):
        load_scenario(path)


RESUME_RUNS = """
[[runs]]
name = "part"
world_size = 2
stop_after = 2

[[runs]]
name = "resumed"
world_size = 2
resume_from = "part"
compare_to = "ddp2"
"""


def test_resume_runs_load(scenario_dir: Path) -> None:
    s = load_scenario(write_scenario(scenario_dir, "res", extra=RESUME_RUNS))
    assert s.run("part").stop_after == 2 and s.run("resumed").resume_from == "part"
    assert Scenario.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(
    ("patch", "expected_key", "message"),
    [
        (("stop_after = 2", "stop_after = 4"), "[[runs]][2].stop_after", "between 1 and 3"),
        (("stop_after = 2", "stop_after = 2\nresume_from = \"resumed\""), "[[runs]][2].resume_from",
         "must come before this run"),
        (("stop_after = 2", ""), "[[runs]][3].resume_from", "writes no checkpoints"),
        (('resume_from = "part"', 'resume_from = "elsewhere"'), "[[runs]][3].resume_from", "path does not exist"),
        (('compare_to = "ddp2"', 'compare_to = "resumed"'), "[[runs]][3].compare_to", "not another run's name"),
        (('compare_to = "ddp2"', "expect_resume_step = 9"), "[[runs]][3].expect_resume_step", "between 1 and 3"),
        (('world_size = 2\nstop_after = 2', 'world_size = 2\nstop_after = 2\nresume_step = 1'),
         "[[runs]][2].resume_step", "needs resume_from"),
        (("[limits]", '[[faults]]\nrank = 0\nstep = 2\naction = "corrupt"\n\n[limits]'), "[[faults]][0].phase",
         "use phase 'checkpoint'"),
        (("[limits]", '[[faults]]\nrank = 0\nstep = 2\naction = "stale_view"\n\n[limits]'), "[[faults]][0].phase",
         "use phase 'resume'"),
        (("[limits]", '[[faults]]\nrank = 0\nstep = 2\nphase = "checkpoint"\naction = "delete"\nfile = "x.bin"'
                      '\n\n[limits]'), "[[faults]][0].file", "must be one of"),
        (("digest_every = 2", "digest_every = 2\nkeep_last = -1"), "[train].keep_last", "must be >= 0"),
    ],
)
def test_bad_resume_keys_are_named(scenario_dir: Path, patch: tuple[str, str], expected_key: str,
                                   message: str) -> None:
    path = write_scenario(scenario_dir, "badres", extra=RESUME_RUNS)
    text = path.read_text()
    assert patch[0] in text
    path.write_text(text.replace(*patch, 1))
    with pytest.raises(ScenarioError) as e:
        load_scenario(path)
    assert str(path) in str(e.value) and expected_key in str(e.value) and message in str(e.value), str(e.value)


def test_a_scenario_extends_another_with_its_own_name_and_tables_laid_over(tmp_path: Path) -> None:
    power = load_scenario(REPO / "scenarios" / "power" / "mlx_lm_lora.toml")
    base = load_scenario(REPO / "scenarios" / "mlx_lm_lora.toml")
    # the set a scenario is in is its own: mlx_lm_lora is in the full set, its power scenario in the power set's
    assert (power.name, power.default, base.default, base.full) == ("mlx_lm_lora_power", True, False, True)
    assert power.seed == base.seed and power.model == base.model and power.train == base.train
    assert power.checks.reference == "single" and power.checks.mutations == "collectives"
    assert [(r.name, r.mutation) for r in power.runs] == [
        ("single", None), ("ddp2", None), ("allreduce_skipped", "allreduce_skipped"),
        ("allreduce_not_averaged", "allreduce_not_averaged"), ("rank_dropped", "rank_dropped"),
        ("straggler", "straggler"), ("rank_killed", "rank_killed"), ("same_rows", "same_rows")]
    assert all(r.world_size == 2 for r in power.runs[1:])
    base_vlm = REPO / "scenarios" / "mlx_vlm_parity.toml"  # 3 runs; a file that extends it and lists 2 has 2
    runs = '[[runs]]\nname = "single"\nworld_size = 1\n\n[[runs]]\nname = "ddp2"\nworld_size = 2\n'
    (tmp_path / "two.toml").write_text(f'[scenario]\nname = "two"\nextends = "{base_vlm}"\n\n{runs}')
    assert [r.name for r in load_scenario(base_vlm).runs] == ["single", "ddp2", "ddp4"]
    assert [r.name for r in load_scenario(tmp_path / "two.toml").runs] == ["single", "ddp2"]  # they replace the base's
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "base.toml").write_text('[scenario]\nname = "base"\nextends = "other.toml"\n')
    (tmp_path / "a.toml").write_text('[scenario]\nname = "a"\nextends = "sub/base.toml"\n')
    with pytest.raises(ScenarioError, match=r"a.toml: \[scenario\].extends: base.toml extends another file itself"):
        load_scenario(tmp_path / "a.toml")
    (tmp_path / "b.toml").write_text('[scenario]\nname = "b"\nextends = "nowhere.toml"\n')
    with pytest.raises(ScenarioError, match=r"b.toml: \[scenario\].extends: scenario file not found: .*nowhere.toml"):
        load_scenario(tmp_path / "b.toml")


@pytest.mark.parametrize("value, says", [
    ("everything", "[checks].mutations: 'everything' is not one of collectives"),
    ("collectives", "[checks].mutations: the reference trainer takes no collective mutation (its all-reduce is its"),
])
def test_collective_mutations_opt_in_is_refused_where_it_cannot_apply(tmp_path: Path, value: str, says: str) -> None:
    path = tmp_path / "s.toml"
    path.write_text((REPO / "scenarios" / "text_parity.toml").read_text()
                    .replace("[checks]\n", f'[checks]\nmutations = "{value}"\n', 1))
    with pytest.raises(ScenarioError) as e:
        load_scenario(path)
    assert says in str(e.value), e.value


def test_collective_mutations_need_a_run_to_copy_and_free_names(tmp_path: Path) -> None:
    base = (REPO / "scenarios" / "mlx_lm_lora.toml").read_text()
    path = tmp_path / "s.toml"
    path.write_text(base.replace('name = "ddp2"\nworld_size = 2', 'name = "ddp2"\nworld_size = 1')
                    .replace('[checks]\n', '[checks]\nmutations = "collectives"\n', 1))
    with pytest.raises(ScenarioError, match="no run to mutate: it copies the first run of world_size >= 2"):
        load_scenario(path)
    path.write_text(base.replace('name = "ddp2"', 'name = "straggler"')
                    .replace('[checks]\n', '[checks]\nmutations = "collectives"\n', 1))
    with pytest.raises(ScenarioError, match="a run is already named 'straggler'"):
        load_scenario(path)
