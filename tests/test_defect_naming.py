"""Defect naming: a failed step-local check names the known DDP defect the trainer's figures match
(``harness.rank.defects``, ``harness.judge.defects``). A user's script (``examples/ddp_train.py``,
which hands over ``run.probe``) with one defect planted per scenario, on real ranks: each is named,
and the correct script names none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, cli, script_scenario

SCRIPT = (REPO / "examples" / "ddp_train.py").read_text()
REDUCTION = """        tokens = mx.distributed.all_sum(mask.sum(), group=group)
        loss_sum, grads = grad_fn(model, inputs, targets, mask)
        # sum over ranks of (local token-loss gradient x N / T), averaged: the global gradient / T
        grads = nn.average_gradients(scaled(grads, size / tokens), group=group)
        return mx.distributed.all_sum(loss_sum, group=group) / tokens, grads, tokens
"""
SHARE = "        mine = [rows[i] for i in batch[rank::size]]\n"
LOCAL = """        all_sum = partial(mx.distributed.all_sum, group=group)
        local = mask.sum()
        tokens = mx.distributed.all_sum(local, group=group)
        loss_sum, grads = grad_fn(model, inputs, targets, mask)
"""
PLANTED = {  # what a user might have written instead, and the defect the harness must name
    "mean_of_means": (LOCAL + """        grads = nn.average_gradients(scaled(grads, 1 / local), group=group)
        return mx.distributed.all_sum(loss_sum / local, group=group) / size, grads, tokens
""", None),
    "no_allreduce": (LOCAL + """        return loss_sum / local, scaled(grads, 1 / local), tokens
""", None),
    "not_divided_by_world": (LOCAL + """        grads = tree_map(all_sum, scaled(grads, 1 / local))
        return mx.distributed.all_sum(loss_sum / local, group=group), grads, tokens
""", None),
    "local_token_count": (LOCAL + """        grads = scaled(tree_map(all_sum, grads), 1 / local)
        return all_sum(loss_sum) / local, grads, tokens
""", None),
    "no_allreduce_scaled": (LOCAL + """        return all_sum(loss_sum) / tokens, scaled(grads, size / tokens), tokens
""", None),
    "grad_times_world": (LOCAL + """        grads = tree_map(all_sum, scaled(grads, size / tokens))
        return mx.distributed.all_sum(loss_sum, group=group) / tokens, grads, tokens
""", None),
    "same_rows": (REDUCTION, "        mine = [rows[i] for i in batch[0::size]]\n"),
    "other_rows": (REDUCTION, "        mine = [rows[(i + rank) % len(rows)] for i in batch[rank::size]]\n"),
    "rank_scaled": (LOCAL + """        from mlx.optimizers import clip_grad_norm  # each rank clips its own: too early
        grads, _ = clip_grad_norm(scaled(grads, size / tokens), 1e-3)
        grads = nn.average_gradients(grads, group=group)
        return mx.distributed.all_sum(loss_sum, group=group) / tokens, grads, tokens
""", None),
}


def planted(defect: str | None) -> str:
    if defect is None:
        return SCRIPT
    reduction, share = PLANTED[defect]
    assert REDUCTION in SCRIPT and SHARE in SCRIPT
    return "from functools import partial\n" + SCRIPT.replace(REDUCTION, reduction).replace(SHARE, share or SHARE)


def scenario(d: Path, defect: str | None) -> Path:
    """1 process and 2 ranks of the planted script, 2 steps, each probed. Naming is the step-local
    checks' (limits from rounding): no noise-floor runs, the trajectory checks' absolute limits loose."""
    path = script_scenario(d, planted(defect), defect or "correct")
    path.write_text(path.read_text().replace("steps = 6\n", "steps = 2\n")
                    .replace('reference = "single"\n', 'reference = "single"\nprobe_every = 1\nnoise_floor = false\n'
                             'loss_tolerance = 0.1\nparam_tolerance = 0.1\neval_tolerance = 0.1\n'))
    return path


@pytest.mark.ranks
def test_each_defect_planted_in_a_script_is_named_and_a_correct_script_names_none(tmp_path: Path) -> None:
    paths = [scenario(tmp_path, d) for d in (None, *PLANTED)]
    p = cli("run", *map(str, paths), "--out", str(tmp_path / "out"))
    doc = json.loads((tmp_path / "out" / "result.json").read_text())
    by = {s["name"]: s for s in doc["scenarios"]}
    correct = [c for c in by["correct"]["checks"] if c["run"] == "ddp2"]
    assert correct and all(c["passed"] and c["defect"] is None for c in correct), p.stdout[-3000:]
    for defect in PLANTED:
        failed = [c for c in by[defect]["checks"] if c["run"] == "ddp2" and not c["passed"]
                  and c["name"] in ("step_loss_parity", "step_grad_parity")]
        assert failed, (defect, p.stdout[-3000:])
        for c in failed:
            print(f"{defect}: {c['name']}: {c['detail']}")
            assert c["defect"] == defect, (defect, c["detail"])
            assert "matches: " in c["detail"] and "against a limit of" in c["detail"]


def test_a_learning_rate_off_by_one_factor_is_named_for_it() -> None:
    from harness.judge.checks import lr_scaled

    ref = [1e-3 * (k + 1) / 4 for k in range(4)]
    assert lr_scaled([2 * x for x in ref], ref, 2, 2.4e-7) == "learning rate x world size 2"
    assert lr_scaled([x / 4 for x in ref], ref, 4, 2.4e-7) == "learning rate / world size 4"
    assert lr_scaled([3 * x for x in ref], ref, 2, 2.4e-7) == "learning rate x 3 at every step"
    assert lr_scaled([x * (1 + k) for k, x in enumerate(ref)], ref, 2, 2.4e-7) is None  # another schedule


def test_a_trajectory_failure_says_which_seam_would_name_its_defect() -> None:
    from harness.judge.checks import Check
    from harness.judge.defects import unnamed_trajectory

    def checks(*failed: str) -> list[Check]:
        names = ("start_parity", "step_loss_parity", "step_grad_parity", "loss_parity", "param_parity")
        return [Check(n, "ddp2", n not in failed, 1.0, 1.0) for n in names]

    script = {"step_grad_parity": "the script hands over no loss-and-gradient function",
              "step_loss_parity": "the same"}  # its step-local checks fail unmeasured, and read n/a
    assert unnamed_trajectory(checks("loss_parity", "step_loss_parity", "step_grad_parity"), 5, script) == (
        "no defect named: it needs step-local values at the reference's parameters, and the script hands over no "
        "loss-and-gradient function")
    assert "[checks] probe_every = 0" in unnamed_trajectory(checks("param_parity"), 0, {})
    assert "the step-local checks passed" in unnamed_trajectory(checks("loss_parity"), 5, {})
    assert unnamed_trajectory(checks("loss_parity", "step_grad_parity"), 5, {}) is None  # named there
    assert unnamed_trajectory(checks("start_parity", "loss_parity"), 5, {}) is None
    assert unnamed_trajectory(checks(), 5, {}) is None
