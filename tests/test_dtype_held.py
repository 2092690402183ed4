"""``dtype_held`` on real ranks: the user's script (``examples/ddp_train.py``) in bfloat16 keeps its
weights bfloat16 and passes; the same script scaling its bfloat16 gradients by a float32 array
without casting them back (what it did before) trains in float32 from its first update, and fails
naming the parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, cli, script_scenario

SCRIPT = (REPO / "examples" / "ddp_train.py").read_text()
CAST = "    return tree_map(lambda g: (g * factor).astype(g.dtype), grads)\n"
PROMOTED = "    return tree_map(lambda g: g * factor, grads)\n"


def scenario(d: Path, script: str, name: str) -> Path:
    path = script_scenario(d, script, name, world_sizes=(2,))
    path.write_text(path.read_text().replace('arch = "llama"\n', 'arch = "llama"\ndtype = "bfloat16"\n')
                    .replace("steps = 6\n", "steps = 2\n"))
    return path


@pytest.mark.ranks
def test_a_script_that_promotes_its_bfloat16_weights_fails_dtype_held_and_the_example_passes(tmp_path: Path) -> None:
    assert CAST in SCRIPT
    paths = [scenario(tmp_path, SCRIPT, "cast"), scenario(tmp_path, SCRIPT.replace(CAST, PROMOTED), "promoted")]
    p = cli("run", *map(str, paths), "--out", str(tmp_path / "out"))
    doc = json.loads((tmp_path / "out" / "result.json").read_text())
    held = {s["name"]: next(c for c in s["checks"] if c["name"] == "dtype_held") for s in doc["scenarios"]}
    assert held["cast"]["passed"] and held["cast"]["value"] == 0, p.stdout[-3000:]
    assert "each in its start dtype at the end, on 2 ranks" in held["cast"]["detail"]
    bad = held["promoted"]
    assert not bad["passed"] and bad["value"] > 0, p.stdout[-3000:]
    assert "bfloat16 -> float32" in bad["detail"] and "ended training in another dtype" in bad["detail"]
    assert p.returncode != 0


@pytest.mark.ranks
def test_unsloth_zoos_own_float32_norm_weights_are_where_its_training_starts(tmp_path: Path) -> None:
    """unsloth-zoo's ``train()`` casts a bfloat16 model's norm weights to float32 before its first
    step, by design: the dtypes its first step starts from are the ones compared, so a correct
    full fine-tune passes while its final norm weights are float32."""
    from tests.conftest import needs_unsloth

    needs_unsloth()
    path = tmp_path / "unsloth_bf16.toml"
    path.write_text(f'[scenario]\nextends = "{REPO / "scenarios" / "unsloth_compiled.toml"}"\nname = "unsloth_bf16"\n'
                    '\n[model]\ndtype = "bfloat16"\n\n[train]\nsteps = 2\neval_every = 0\ndigest_every = 1\n'
                    '\n[[runs]]\nname = "single"\nworld_size = 1\n\n[checks]\nreference = "single"\n')
    p = cli("run", str(path), "--out", str(tmp_path / "out"))
    doc = json.loads((tmp_path / "out" / "result.json").read_text())
    held = next(c for c in doc["scenarios"][0]["checks"] if c["name"] == "dtype_held")
    assert held["passed"], (held, p.stdout[-3000:])
    assert "of them cast by the trainer's own setup before its first step" in held["detail"], held["detail"]


@pytest.mark.ranks
def test_a_float32_script_that_casts_its_model_after_training_started_fails_dtype_held(tmp_path: Path) -> None:
    """In float32 the defect is the other way: the script casts the model ``run.model()`` built
    (where training starts) to bfloat16, so it trains narrower than the run it reports."""
    built = "    model = run.model()\n"
    assert built in SCRIPT
    path = script_scenario(tmp_path, SCRIPT.replace(built, built + "    model.set_dtype(mx.bfloat16)\n"), "narrowed",
                           world_sizes=(2,))
    path.write_text(path.read_text().replace("steps = 6\n", "steps = 2\n"))
    p = cli("run", str(path), "--out", str(tmp_path / "out"))
    doc = json.loads((tmp_path / "out" / "result.json").read_text())
    held = next(c for c in doc["scenarios"][0]["checks"] if c["name"] == "dtype_held")
    assert not held["passed"] and held["value"] > 0, p.stdout[-3000:]
    assert "float32 -> bfloat16" in held["detail"] and "cast the model before saying where training starts" in \
        held["detail"]
