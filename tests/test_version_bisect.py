"""``gate --bisect-versions PACKAGE==V1..V2`` on real ranks, over four locally built releases of
a package that a user's script calls for its gradient all-reduce: the release that leaves the
all-reduce out is named by its failing checks; and bad input is one line."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from harness.exit_codes import EXIT_BAD_INPUT, EXIT_CHECK_FAILED
from tests.conftest import EXAMPLE, script_scenario

GOOD_BODY = "def average_gradients(nn, grads, group):\n    return nn.average_gradients(grads, group=group)\n"
BAD_BODY = "def average_gradients(nn, grads, group):\n    return grads  # the all-reduce left out\n"
CALL = ("nn.average_gradients(scaled(grads, size / tokens), group=group)",
        "ddpprobe.average_gradients(nn, scaled(grads, size / tokens), group=group)")


def _wheel(where: Path, version: str, body: str) -> Path:
    """A pure-Python wheel of the package ``ddpprobe`` at ``version``."""
    dist = f"ddpprobe-{version}.dist-info"
    files = {"ddpprobe/__init__.py": f"__version__ = {version!r}\n{body}",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: ddpprobe\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}

    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{n},sha256={digest(t)},{len(t.encode())}\n" for n, t in files.items()) + f"{dist}/RECORD,,\n"
    path = where / f"ddpprobe-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, f"{dist}/RECORD": record}.items():
            z.writestr(name, text)
    return path


def _bisect(tmp_path: Path, spec: str, *flags: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "out"
    env = {**os.environ, "MLX_DDP_HARNESS_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-m", "harness", "gate", "--bisect-versions", spec, *flags, "--out", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    record = out / "bisect.json"
    return p, json.loads(record.read_text()) if record.exists() else None


@pytest.mark.ranks
@pytest.mark.full  # four environments built and about 12 runs of a script
def test_the_release_that_breaks_a_scripts_parity_is_named(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for version, body in (("1.0", GOOD_BODY), ("1.1", GOOD_BODY), ("1.2", BAD_BODY), ("1.3", BAD_BODY)):
        _wheel(wheels, version, body)
    script = EXAMPLE.read_text()
    assert script.count(CALL[0]) == 1
    script = script.replace(CALL[0], CALL[1]).replace("from harness import api\n", "import ddpprobe\n\nfrom harness "
                                                                                    "import api\n")
    path = script_scenario(tmp_path, script, "probe_script")
    p, record = _bisect(tmp_path, "ddpprobe==1.0..1.3", str(path), "--find-links", str(wheels), "--no-index",
                        "--metrics", "checks", "--pairs", "2", "--min-pairs", "2")
    assert p.returncode == EXIT_CHECK_FAILED, p.stdout[-3000:] + p.stderr[-3000:]
    assert 'first bad release: 1.2 "ddpprobe 1.2"' in p.stdout, p.stdout
    assert record["answer"]["first_bad"]["sha"] == "1.2" and record["answer"]["last_good"]["sha"] == "1.1"
    deciding = next(x for x in record["probes"] if x["commit"]["sha"] == "1.2")
    assert deciding["metric"] == "checks probe_script/ddp2" and "param_parity" in deciding["figure"], deciding
    built = sorted(d.name.split("-")[1] for d in (tmp_path / "cache" / "envs").iterdir())
    assert "1.0" in built and "1.2" in built  # each release's environment, kept
    probed = {x["commit"]["sha"] for x in record["probes"]} | {"1.0"}
    assert sorted(ln for ln in p.stderr.splitlines() if ln.endswith(": environment built")) == sorted(
        f"ddpprobe {v}: environment built" for v in probed)  # each built once


@pytest.mark.parametrize(("spec", "needle"), [
    ("ddpprobe==1.0", "give PACKAGE==V1..V2"),
    ("ddpprobe==1.0..1.9", "ddpprobe 1.9 is not among the releases"),
    ("ddpprobe==1.1..1.0", "1.1 is not older than 1.0"),
])
def test_bad_version_bisect_input_is_one_line(tmp_path: Path, spec: str, needle: str) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for version in ("1.0", "1.1"):
        _wheel(wheels, version, GOOD_BODY)
    p, _ = _bisect(tmp_path, spec, str(EXAMPLE), "--find-links", str(wheels), "--no-index")
    assert p.returncode == EXIT_BAD_INPUT and needle in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
