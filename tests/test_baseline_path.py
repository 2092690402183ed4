"""``baseline update --baseline PATH``: it says whether it wrote the file PATH names or a file named
after the platform in the directory PATH, and refuses a new path that does not say which (one
line, exit 2, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness import schema
from harness.judge.baselines import BaselineError, baseline_target
from harness.present.baseline_cli import baseline_filename
from tests.conftest import cli

ENV = {"os_name": "Linux", "cpu": "Test CPU", "device": "Device(cpu, 0)", "mlx_version": "0.32.4",
       "git_revision": "abc1234"}


def _results(path: Path, *tok_s: float) -> Path:
    """A result.json holding one run with a repeat per speed."""
    repeats = [{"ok": True, "median_tok_s": v, "runtime_s": 1.0, "losses": [5.0, 4.0], "mlx_peak_bytes": [1 << 20],
                "rss_peak_bytes": [1 << 26], "avg_loss": 4.5, "final_loss": 4.0} for v in tok_s]
    doc: dict[str, Any] = schema.stamp({"passed": True, "exit_code": 0, "environment": ENV, "scenarios": [
        {"name": "s", "kind": "parity", "model": "qwen3", "runs": [
            {"name": "single", "world_size": 1, **repeats[0], "repeats": repeats}]}]})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def _last_line(stdout: str) -> str:
    return stdout.strip().splitlines()[-1]


def test_the_rule_for_a_baseline_path(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "plain").write_text("{}")
    assert baseline_target(str(tmp_path / "dir")) == (tmp_path / "dir", True)  # exists: as it is
    assert baseline_target(str(tmp_path / "plain")) == (tmp_path / "plain", False)
    assert baseline_target(f"{tmp_path}/new/") == (tmp_path / "new", True)  # new: the name says which
    assert baseline_target(f"{tmp_path}/new.json") == (tmp_path / "new.json", False)
    for given, message in ((f"{tmp_path}/baselines", "no such file or directory; say which to write: "
                                                     f"{tmp_path}/baselines.json for a file, {tmp_path}/baselines/ "
                                                     "for a directory"),
                           (f"{tmp_path}/plain/", "is a file, not a directory"),
                           (f"{tmp_path}/no/such.json", f"{tmp_path}/no: no such directory"),
                           (f"{tmp_path}/no/such/", f"{tmp_path}/no: no such directory")):
        with pytest.raises(BaselineError, match="^--baseline ") as e:
            baseline_target(given)
        assert message in str(e.value), given


def test_baseline_update_says_what_it_wrote_and_refuses_an_ambiguous_path(tmp_path: Path) -> None:
    results = _results(tmp_path / "runs" / "result.json", 1000.0, 1010.0)
    name = baseline_filename(ENV)

    ambiguous = cli("baseline", "update", "--baseline", "baselines", str(results), cwd=tmp_path)
    assert ambiguous.returncode == 2 and ambiguous.stdout == ""
    assert ambiguous.stderr == ("error: --baseline baselines: no such file or directory; say which to write: "
                                "baselines.json for a file, baselines/ for a directory (its file named after the "
                                "platform)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing written, no directory made

    new_dir = cli("baseline", "update", "--baseline", "baselines/", str(results), cwd=tmp_path)
    assert new_dir.returncode == 0, new_dir.stderr
    assert _last_line(new_dir.stdout) == (f"wrote baselines/{name} (a file named after this platform, in the new "
                                          "directory baselines)")
    assert json.loads((tmp_path / "baselines" / name).read_text())["kind"] == "baseline"

    again = cli("baseline", "update", "--baseline", "baselines", str(results), cwd=tmp_path)  # exists now: a dir
    assert again.returncode == 0, again.stderr
    assert _last_line(again.stdout) == f"wrote baselines/{name} (a file named after this platform, in the directory " \
                                       "baselines)"
    assert sorted(p.name for p in (tmp_path / "baselines").iterdir()) == [name]

    new_file = cli("baseline", "update", "--baseline", "base.json", str(results), cwd=tmp_path)
    assert new_file.returncode == 0, new_file.stderr
    assert _last_line(new_file.stdout) == "wrote base.json (a file, as --baseline names one)"
    (tmp_path / "base.json").rename(tmp_path / "kept-base")  # an existing file without .json: still a file
    kept = cli("baseline", "update", "--baseline", "kept-base", str(results), cwd=tmp_path)
    assert kept.returncode == 0, kept.stderr
    assert _last_line(kept.stdout) == "wrote kept-base (a file, as --baseline names one)"
    assert json.loads((tmp_path / "kept-base").read_text())["scenarios"]["s"]["single"]["repeats"] == 2
