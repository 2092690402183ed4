"""Step-local probes of external trainers (mlx-vlm, unsloth-zoo), real ranks under mlx.launch.

Each trainer computes its global loss, token count and all-reduced gradient at the reference's
parameters through its own loss and reduction: a correct trainer passes the step-local checks
clearly, here with gradient accumulation, so every micro-batch of a probe step is probed. The
shipped scenarios are shortened to 1 process and 2 ranks, 6 steps (probes at steps 1 and 5),
without their expected-failure markers. A known behaviour shows in them from the first probe
step: ``tests/test_scenarios.py`` asserts it on the shipped ``mlx_vlm_mean_of_means`` and
``unsloth_default_order``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, cli, needs_unsloth

STEP_CHECKS = ("step_token_parity", "step_loss_parity", "step_grad_parity")


def shortened(name: str, tmp: Path, **train: int) -> Path:
    """Shipped scenario ``name`` as 1 process and 2 ranks, 6 steps (``train``: other [train]
    settings), data paths absolute, no expected-failure markers."""
    body = (REPO / "scenarios" / f"{name}.toml").read_text()
    body = re.sub(r'"(data/[^"]+)"', lambda m: f'"{REPO / "scenarios" / m.group(1)}"', body)
    body = re.sub(r'\[\[runs\]\]\nname = "ddp4"\nworld_size = 4\n', "", body)
    body = re.sub(r"(?ms)^\[checks\.expected_failures[^\n]*\n.*?(?=^\[(?!checks\.expected_failures)|\Z)", "", body)
    settings = {"steps": 6, **train}
    for key, value in settings.items():
        body, n = re.subn(rf"(?m)^{key} = \d+", f"{key} = {value}", body)
        if not n:
            body = body.replace("[train]\n", f"[train]\n{key} = {value}\n", 1)
    assert "expected_failures" not in body and 'name = "ddp4"' not in body
    path = tmp / f"{name}.toml"
    path.write_text(body)
    return path


def step_checks(path: Path, out: Path, rc: int) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    p = cli("run", str(path), "--out", str(out))
    assert p.returncode == rc, p.stdout[-4000:] + p.stderr[-2000:]
    (s,) = json.loads((out / "result.json").read_text())["scenarios"]
    checks = {c["name"]: c for c in s["checks"] if c["run"] == "ddp2" and c["name"] in STEP_CHECKS}
    return checks, {r["name"]: r for r in s["runs"]}


def assert_probed(runs: dict[str, Any]) -> None:
    """The reference recorded steps 1 and 5; the 2-rank run probed them on every rank."""
    assert [p["step"] for p in runs["single"]["probes"][0]] == [1, 5]
    assert [[p["step"] for p in rank] for rank in runs["ddp2"]["probes"]] == [[1, 5], [1, 5]]


def assert_clear_pass(checks: dict[str, dict[str, Any]]) -> None:
    for name in STEP_CHECKS:
        c = checks[name]
        assert c["result"] == "pass" and c["value"] * 3 <= c["limit"], c


@pytest.mark.ranks
def test_mlx_vlm_probes_pass_with_equal_answers(tmp_path: Path) -> None:
    """mlx_vlm_parity (answers of one length) with 2 micro-batches a step: mlx-vlm's mean of the
    ranks' means equals the token-weighted gradient, and its step-local figures match one process."""
    checks, runs = step_checks(shortened("mlx_vlm_parity", tmp_path, grad_accum=2, eval_batch=2), tmp_path / "o", 0)
    assert_clear_pass(checks)
    assert_probed(runs)


@pytest.mark.ranks
def test_unsloth_probes_pass_token_weighted(tmp_path: Path) -> None:
    """unsloth_parity (response-only rows of varying length) with 2 micro-batches a step:
    unsloth-zoo weights by tokens across ranks, and its step-local figures match one process."""
    needs_unsloth()
    checks, runs = step_checks(shortened("unsloth_parity", tmp_path, grad_accum=2), tmp_path / "o", 0)
    assert_clear_pass(checks)
    assert_probed(runs)
