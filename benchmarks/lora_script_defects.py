"""A user's LoRA script, correct and with one DDP defect planted at a time, in float32 and bfloat16.

``examples/lora_train.py`` (a bfloat16 or float32 base, mlx-lm's LoRA adapters, AdamW, the gradient
clipped after the all-reduce, ``run.probe``) runs as ``examples/lora_script.toml`` plans it (1
process against 2 and 4 ranks), with no ``[model] dtype``: the dtype comes from ``LORA_DTYPE``,
which the script casts its base to. The correct script must not FAIL (it passes, or reads
INCONCLUSIVE where a trajectory check has no power) and each planted defect must FAIL, named:

- ``mean_of_means``: each rank's loss and gradient divided by its own token count, then averaged;
- ``unseeded_adapters``: the adapters drawn from MLX's global RNG without seeding it;
- ``clip_before_allreduce``: each rank clips its own gradient before the all-reduce;
- ``lr_times_world``: the learning rate multiplied by the world size;
- ``rank_shuffle``: each rank shuffles the rows with its own seed.

The defective runs are judged without noise-floor runs (their step-local checks, the start, the
schedule and the token counts name them; the trajectories' absolute limits loosened), the correct
one with them. Prints a row per (dtype, script, run): the verdict, the checks that failed and the
defect named.

usage: python benchmarks/lora_script_defects.py [--dtypes float32,bfloat16] [--only NAME,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
SCRIPT = (REPO / "examples" / "lora_train.py").read_text()
SCENARIO = (REPO / "examples" / "lora_script.toml").read_text()
REDUCE = """        grads = tree_map(lambda g: mx.distributed.all_sum(g, group=group) / tokens, grads)
        return mx.distributed.all_sum(loss_sum, group=group) / tokens, grads, tokens
"""
PLANTED = {  # what a user might have written instead
    "mean_of_means": [(REDUCE, """        local = mask.sum()
        grads = tree_map(lambda g: mx.distributed.all_sum(g / local, group=group) / size, grads)
        return mx.distributed.all_sum(loss_sum / local, group=group) / size, grads, tokens
""")],
    "unseeded_adapters": [("    mx.random.seed(run.seed)  # mlx-lm draws", "    # mlx-lm draws")],
    "clip_before_allreduce": [(REDUCE, """        own = tree_map(lambda g: g / tokens, grads)
        grads, _ = optim.clip_grad_norm(own, 1.0)  # by this rank's own norm
        grads = tree_map(lambda g: mx.distributed.all_sum(g, group=group), grads)
        return mx.distributed.all_sum(loss_sum, group=group) / tokens, grads, tokens
""")],
    "lr_times_world": [("AdamW(learning_rate=run.learning_rate)", "AdamW(learning_rate=run.learning_rate * size)")],
    "rank_shuffle": [("np.random.default_rng(run.seed)", "np.random.default_rng(run.seed + rank)")],
}
NO_FLOORS = ('reference = "single"\n', 'reference = "single"\nnoise_floor = false\nloss_tolerance = 10.0\n'
                                       'param_tolerance = 10.0\neval_tolerance = 10.0\n')


def planted(name: str) -> str:
    src = SCRIPT
    for old, new in PLANTED.get(name, []):
        if src.count(old) != 1:
            raise SystemExit(f"examples/lora_train.py: the text to plant {name} in was not found: {old!r}")
        src = src.replace(old, new)
    return src


def judged(d: Path, name: str, dtype: str) -> dict:
    """One script's scenario run in ``dtype``: its judged scenario."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "lora_train.py").write_text(planted(name))
    toml = SCENARIO.replace('path = "lora_train.py"', f'path = "{d / "lora_train.py"}"')
    toml = toml.replace('path = "../scenarios/data/chat.jsonl"', f'path = "{REPO / "scenarios/data/chat.jsonl"}"')
    if name != "correct":
        toml = toml.replace(*NO_FLOORS)
    (d / "s.toml").write_text(toml.replace('name = "lora_script"', f'name = "{name}"'))
    subprocess.run([sys.executable, "-m", "harness", "run", str(d / "s.toml"), "--out", str(d / "out"),
                    "--no-plots"], cwd=REPO, env={**os.environ, "LORA_DTYPE": dtype}, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)
    return json.loads((d / "out" / "result.json").read_text())["scenarios"][0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--only", default=None, help="the scripts to run (correct and the defects' names)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else ["correct", *PLANTED]
    keep = args.out or Path(tempfile.mkdtemp(prefix="lora-defects-"))
    rows, wrong = [], []
    for dtype in args.dtypes.split(","):
        for name in names:
            s = judged(keep / f"{dtype}-{name}", name, dtype)
            for run in ("ddp2", "ddp4"):
                cs = [c for c in s["checks"] if c["run"] == run]
                failed = [c for c in cs if c["result"] == "FAIL"]
                undecided = [c["name"] for c in cs if c["result"] == "INCONCLUSIVE"]
                named = sorted({c["defect"] for c in failed if c.get("defect")})
                verdict = "FAIL" if failed else "INCONCLUSIVE" if undecided else "pass"
                rows.append([dtype, name, run, verdict, ", ".join(c["name"] for c in failed) or "-",
                             ", ".join(named) or "-", ", ".join(undecided) or "-"])
                if (name == "correct") != (verdict != "FAIL"):
                    wrong.append(f"{dtype} {name} {run}: {verdict}")
    print(tabulate(rows, headers=["dtype", "script", "run", "verdict", "failed", "defect named", "INCONCLUSIVE"]))
    print(f"results in {keep}")
    if wrong:
        print("not as it must be: " + "; ".join(wrong))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
