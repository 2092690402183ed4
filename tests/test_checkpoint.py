"""Checkpoint files: atomic writes, keep_last, partial directories, and refusals that name the file.

These are the file-format rules alone; resuming with real ranks is proven by the resume
scenarios (tests/test_scenarios.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from harness.scenario import load_scenario
from harness.trainers.reference import checkpoint as ck
from harness.trainers.reference.resume import check_fits, fingerprint
from tests.conftest import REPO


def _write(root: Path, step: int, keep_last: int = 2, between=None) -> dict:  # noqa: ANN001
    params = {"w": mx.arange(12, dtype=mx.float32).reshape(3, 4) * step}
    opt = {"step": mx.array(step, dtype=mx.uint64), "w.m": mx.ones((3, 4)) * step}
    state = {"format": ck.FORMAT, "step": step, "seed": 3}
    return ck.write(root, step, params, opt, state, keep_last, between)


def test_write_then_read_round_trips_bitwise(tmp_path: Path) -> None:
    info = _write(tmp_path, 8)
    assert Path(info["path"]).name == "step-00000008" and info["bytes"] > 0
    c = ck.resolve(tmp_path)
    assert c.step == 8 and c.skipped_partials == []
    ck.verify(c)
    params, opt, state = ck.read(c)
    assert mx.array_equal(params["w"], mx.arange(12, dtype=mx.float32).reshape(3, 4) * 8).item()
    assert opt["step"].dtype == mx.uint64 and opt["step"].item() == 8
    assert state == {"format": ck.FORMAT, "step": 8, "seed": 3}
    manifest = json.loads((Path(info["path"]) / ck.MANIFEST).read_text())
    assert set(manifest["files"]) == set(ck.FILES)
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values())


def test_keep_last_removes_older_checkpoints_only_after_a_newer_one_is_complete(tmp_path: Path) -> None:
    removed = [_write(tmp_path, s, keep_last=2)["removed"] for s in (4, 8, 12)]
    assert removed == [[], [], ["step-00000004"]]
    assert ck.complete_steps(tmp_path) == [8, 12]

    def die(name: str) -> None:
        raise KeyboardInterrupt  # the writer dies mid-write

    with pytest.raises(KeyboardInterrupt):
        _write(tmp_path, 16, keep_last=2, between=die)
    assert ck.complete_steps(tmp_path) == [8, 12]  # nothing pruned for an incomplete checkpoint
    assert len(ck.partials(tmp_path)) == 1
    c = ck.resolve(tmp_path)
    assert c.step == 12 and c.skipped_partials == ck.partials(tmp_path)


def test_keep_last_zero_keeps_everything(tmp_path: Path) -> None:
    for s in (1, 2, 3):
        _write(tmp_path, s, keep_last=0)
    assert ck.complete_steps(tmp_path) == [1, 2, 3]


def test_a_later_writer_removes_partials_of_writers_that_are_gone(tmp_path: Path) -> None:
    (tmp_path / ".partial-step-00000004-1").mkdir(parents=True)
    assert _write(tmp_path, 8)["removed"] == [".partial-step-00000004-1"]
    assert ck.partials(tmp_path) == []


@pytest.mark.parametrize(
    ("how", "name", "message"),
    [
        ("truncate", ck.MODEL, "bytes, the manifest says"),
        ("corrupt", ck.OPTIMIZER, "does not match the manifest's"),
        ("delete", ck.TRAINER, "missing (the manifest lists it)"),
    ],
)
def test_damaged_files_are_refused_naming_the_file_and_the_previous_one_stays_usable(
        tmp_path: Path, how: str, name: str, message: str) -> None:
    _write(tmp_path, 4)
    info = _write(tmp_path, 8)
    ck.damage(Path(info["path"]) / name, how)
    with pytest.raises(ck.CheckpointError) as e:
        ck.verify(ck.resolve(tmp_path))
    assert str(e.value).startswith(str(Path(info["path"]) / name)) and message in str(e.value)
    assert "\n" not in str(e.value)
    previous = ck.resolve(tmp_path, 4)
    ck.verify(previous)
    assert ck.read(previous)[2]["step"] == 4


@pytest.mark.parametrize(
    ("manifest", "message"),
    [(None, "manifest.json: unreadable"), ("{not json", "manifest.json: not valid JSON"),
     ('{"format": 1, "step": 8, "files": {}}', "manifest.json: lists [], expected")],
)
def test_a_bad_manifest_is_refused_naming_it(tmp_path: Path, manifest: str | None, message: str) -> None:
    info = _write(tmp_path, 8)
    path = Path(info["path"]) / ck.MANIFEST
    if manifest is None:
        path.unlink()
    else:
        path.write_text(manifest)
    with pytest.raises(ck.CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ck.resolve(tmp_path)


def test_resolve_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ck.CheckpointError, match="checkpoint directory not found"):
        ck.resolve(tmp_path / "nope")
    (tmp_path / ".partial-step-00000004-9").mkdir()
    with pytest.raises(ck.CheckpointError, match=r"no complete checkpoint \(unfinished: .partial-step-00000004-9\)"):
        ck.resolve(tmp_path)
    _write(tmp_path, 4)
    _write(tmp_path, 8)
    with pytest.raises(ck.CheckpointError, match=r"no checkpoint for step 6 \(complete: 4, 8\)"):
        ck.resolve(tmp_path, 6)
    assert ck.resolve(tmp_path / "step-00000004").step == 4  # a step directory itself
    assert ck.resolve(tmp_path, hide_newest=True).step == 4  # a stale view misses the newest


def test_a_checkpoint_refuses_another_global_batch_or_trajectory_but_not_another_world_size() -> None:
    s = load_scenario(REPO / "scenarios" / "resume_parity.toml")
    state = {"format": ck.FORMAT, "fingerprint": fingerprint(s)}
    check_fits(state, s.for_run(s.run("full4")), "t.json")  # 4 ranks resume a 1-rank checkpoint
    bigger = s.for_run(s.run("full2"))
    bigger.train.global_batch = 16
    with pytest.raises(ck.CheckpointError, match="t.json: made with global_batch 8, this run has 16; refusing"):
        check_fits(state, bigger, "t.json")
    other_lr = s.for_run(s.run("full2"))
    other_lr.train.learning_rate = 1e-4
    with pytest.raises(ck.CheckpointError, match=r"made with train.learning_rate = 0.003, this run has 0.0001"):
        check_fits(state, other_lr, "t.json")
    reseeded = s.for_run(s.run("resumed2"))  # another seed is not another trajectory: the checkpoint's is used
    assert reseeded.seed == 99
    check_fits(state, reseeded, "t.json")
