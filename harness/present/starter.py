"""``mlx-ddp-harness new``: a commented scenario written from a few flags, which runs as written.

The file compares N ranks with the first (smallest) run at one global batch, for the trainer the
flags name (a registered kind, or the user's script), on generated rows or the user's JSONL, with
a local ``tokenizer.json`` where given; ``--lora`` fine-tunes LoRA adapters, ``--throughput``
times the runs instead (every rank trains the same rows a step; speed vs the first run). Before
anything is written it is loaded and its inputs checked as ``run`` checks them, so a file that
``new`` writes is one ``run`` accepts; where the trainer has a documented behaviour on these
rows (``starter_blocks.mean_of_means``), the file marks it as an expected failure and says so.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from harness.present.starter_blocks import PER_RANK_BATCH, lora_lines, mean_of_means, throughput_runs, uses_harness_api
from harness.scenario import Scenario, ScenarioError, load_scenario
from harness.scenario.spec import TrainerSpec
from harness.scenario.trainers import TrainerInfo, trainer_info, trainers, with_kind

Check = Callable[[Scenario, str | None], list[str]]

ARCH = {"text": "qwen3", "any": "qwen3", "vision": "qwen2_vl"}


def add_parser(sub: argparse._SubParsersAction, check: Check) -> None:
    """The ``new`` command; ``check`` refuses what ``run`` refuses before launch and returns its notes."""
    n = sub.add_parser("new", help="write a commented parity scenario to start from (it runs as written)",
                       description="Write a parity scenario: N ranks against one process at the same global batch "
                                   "(--throughput: a throughput scenario).")
    n.add_argument("file", metavar="FILE.toml", help="the scenario file to write (an existing file is kept)")
    who = n.add_mutually_exclusive_group()
    who.add_argument("--trainer", default=TrainerSpec.kind, metavar="KIND",
                     help=f"the trainer under test: a kind `mlx-ddp-harness list` shows (default: {TrainerSpec.kind})")
    who.add_argument("--script", metavar="PATH", help="your own training script (reports through harness.api)")
    who.add_argument("--command", metavar="PATH",
                     help="an executable of any language as the ranks (reports through docs/rank-protocol.md)")
    n.add_argument("--data", metavar="FILE.jsonl", help="training rows (default: generated rows)")
    n.add_argument("--eval-data", metavar="FILE.jsonl", help="held-out rows for the sharded evaluation")
    n.add_argument("--tokenizer", metavar="FILE", help="a local tokenizer.json (default: UTF-8 bytes)")
    n.add_argument("--world-sizes", default="1,2", metavar="N,N",
                   help="the runs' rank counts; the first is the reference (default: 1,2)")
    n.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default: 20)")
    n.add_argument("--lora", action="store_true",
                   help=f"fine-tune LoRA adapters (a trainer kind with LoRA{_lora_kinds()})")
    n.add_argument("--throughput", action="store_true",
                   help=f"a throughput scenario: every rank trains {PER_RANK_BATCH} rows a step, tok/s vs the "
                        "first run, no parity")
    n.add_argument("--force", action="store_true",
                   help="write it even for a --script that never imports harness.api (it would report no steps)")
    n.set_defaults(func=functools.partial(cmd_new, check=check))


def _lora_kinds() -> str:
    """``: kind, kind`` for the help, from the records (nothing where an entry point is bad: the
    command then says why)."""
    try:
        return f": {', '.join(with_kind('lora'))}"
    except ScenarioError:
        return ""


def world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(w) for w in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(w < 1 for w in sizes) or len(set(sizes)) != len(sizes):
        raise ScenarioError(f"--world-sizes: expected distinct rank counts such as 1,2,4, got {text!r}")
    return sizes


def _rel(path: str, base: Path, flag: str) -> str:
    p = Path(path).resolve()
    if not p.exists():
        raise ScenarioError(f"{flag}: {path}: no such file")
    return Path(os.path.relpath(p, base)).as_posix()


def _info(kind: str, script: str | None, command: str | None) -> TrainerInfo:
    """The record of the trainer the flags name: the script kind, the command kind, or ``kind``."""
    if script or command:
        return trainer_info(with_kind("script" if script else "command")[0])
    return trainer_info(kind)


def starter_text(name: str, base: Path, kind: str, script: str | None, data: str | None, eval_data: str | None,
                 tokenizer: str | None, sizes: list[int], steps: int, command: str | None = None,
                 lora: bool = False, throughput: bool = False) -> str:
    """The scenario file's text; paths are written relative to ``base``, the file's directory."""
    info = _info(kind, script, command)
    vision = info.models == "vision"
    batch = PER_RANK_BATCH * sizes[0] if throughput else math.lcm(*sizes) * max(1, math.ceil(8 / math.lcm(*sizes)))
    runs = [("single" if n == 1 else f"ddp{n}", n) for n in sizes]
    who = f"the script {script}" if script else f"the executable {command}" if command else info.title
    who += " with LoRA adapters" if lora else ""
    against = "one process" if sizes[0] == 1 else f"{sizes[0]} ranks"
    ranks = " and ".join(str(n) for n in sizes)
    lines = [
        f"# {name}: how fast does {who} train at {ranks} ranks (speed vs {runs[0][0]}; no parity)?" if throughput
        else f"# {name}: does {who} train the same under DDP as in {against}?",
        "# Written by `mlx-ddp-harness new`.",
        f"#   run it:        mlx-ddp-harness run {name}.toml",
        "#   every key:     docs/scenarios.md; every check and how its limit is derived: docs/checks.md",
        "",
        "[scenario]",
        f'name = "{name}"',
        f'description = "{who}: {" vs ".join(r for r, _ in runs)} at '
        + (f'{PER_RANK_BATCH} rows per rank a step, tok/s"' if throughput else f'global batch {batch}"'),
        "seed = 1             # every rank derives its randomness (weights, data order) from it",
    ]
    if throughput:
        lines.append('kind = "throughput"   # runs at other global batches, judged by speed against the first')
    lines.append("")
    if script or command or kind != TrainerSpec.kind:
        lines += ["[trainer]", f'kind = "{info.kind}"']
        if script:
            lines += [f'path = "{_rel(script, base, "--script")}"',
                      "# saves = true     # declare it if the script saves on rank 0: the checks then demand it"]
        if command:
            lines += [f'path = "{_rel(command, base, "--command")}"', "args = []          # its command line"]
        if lora:
            lines += lora_lines(info)
        lines.append("")
    lines += ["[model]", f'arch = "{ARCH[info.models]}"   # a tiny model with seeded random weights; '
                         'path = "DIR" loads a local one', ""]
    evals = not throughput and bool(eval_data or not data)  # held-out rows: a sharded evaluation halfway and at the end
    lines.append("[data]")
    if data:
        lines += ['source = "jsonl"', f'path = "{_rel(data, base, "--data")}"   # every row is read and checked '
                                      "before any rank starts"]
        if eval_data and evals:
            lines.append(f'eval_path = "{_rel(eval_data, base, "--eval-data")}"')
    elif vision:
        lines += ['source = "images"   # generated images with captions', "rows = 32"] + ["eval_rows = 8"] * evals
    else:
        lines += ['source = "generated"   # rows of different lengths with a learnable pattern', "rows = 64"] + \
            ["eval_rows = 16"] * evals
    if tokenizer:
        lines.append(f'tokenizer = "{_rel(tokenizer, base, "--tokenizer")}"')
    split = (f"# {sizes[0]} rank{'s' * (sizes[0] > 1)} x {PER_RANK_BATCH} rows" if throughput else
             "# split across the ranks: a multiple of every world size")
    lines += ["max_seq_len = 128", "", "[train]", f"steps = {steps}", f"global_batch = {batch}   {split}",
              "learning_rate = 1e-3"]
    if command:
        lines.append('optimizer = "sgd"   # given in MLX_DDP_HARNESS_OPTIMIZER: "sgd" or "adamw", as it supports')
    if evals:
        lines.append(f"eval_every = {max(1, steps // 2)}")
    if info.eval_batch_note and evals:
        lines.append(f"eval_batch = {batch}   # {info.eval_batch_note}")
    lines.append("")
    if throughput:
        lines += throughput_runs(runs)
        lines += ["[checks]", f'reference = "{runs[0][0]}"   # every run\'s speed is shown against this one', ""]
    else:
        for run, n in runs:
            lines += ["[[runs]]", f'name = "{run}"', f"world_size = {n}", ""]
        lines += ["[checks]", f'reference = "{runs[0][0]}"   # every other run is judged against this one', ""]
    return "\n".join(lines)


def _load_checked(path: Path, text: str, check: Check) -> tuple[Scenario, list[str], Path]:
    """``text`` written to a temporary file beside ``path``, loaded and checked as ``run`` checks
    it: the scenario, the check's notes and the file (the caller keeps or removes it). An error
    names ``path``, the file asked for."""
    with tempfile.NamedTemporaryFile("w", suffix=".toml", dir=path.parent, delete=False) as f:
        f.write(text)
    try:
        s = load_scenario(f.name)
        return s, check(s, None), Path(f.name)  # the data, tokenizer and backends as run checks them
    except ScenarioError as e:  # said of the file asked for, which was not written
        Path(f.name).unlink(missing_ok=True)
        raise ScenarioError(str(e).replace(f.name, str(path))) from e


def _refuse(args: argparse.Namespace, path: Path) -> None:
    """Flags ``new`` refuses in one line before writing anything."""
    if path.suffix != ".toml":
        raise ScenarioError(f"{path}: a scenario file ends in .toml")
    if path.exists():
        raise ScenarioError(f"{path}: exists; give another name (nothing was written)")
    if not path.parent.is_dir():
        raise ScenarioError(f"{path.parent}: no such directory")
    if args.steps < 1:
        raise ScenarioError(f"--steps must be at least 1, got {args.steps}")
    kinds = [t.kind for t in trainers().values() if not (t.script or t.command)]
    if not (args.script or args.command) and args.trainer not in kinds:
        raise ScenarioError(f"--trainer: unknown kind {args.trainer!r}; one of {', '.join(kinds)} (or --script PATH, "
                            f"--command PATH)")
    if args.throughput and args.eval_data:
        raise ScenarioError("--eval-data: a throughput scenario times training only; leave --eval-data out")
    info = _info(args.trainer, args.script, args.command)
    if args.lora and not info.lora:
        with_lora = ", ".join(t.kind for t in trainers().values() if t.lora)
        raise ScenarioError(f"--lora: {info.title} has no LoRA; the trainer kinds with LoRA: {with_lora} "
                            "(--trainer KIND)")


def cmd_new(args: argparse.Namespace, check: Check) -> int:
    path = Path(args.file)
    _refuse(args, path)
    text = starter_text(path.stem, path.parent.resolve(), args.trainer, args.script, args.data, args.eval_data,
                        args.tokenizer, world_sizes(args.world_sizes), args.steps, args.command, args.lora,
                        args.throughput)
    if args.script and not uses_harness_api(Path(args.script)):
        line = (f"{args.script} never imports harness.api, so its runs will report no steps: docs/scripts.md shows "
                "the calls a script makes")
        if not args.force:
            raise ScenarioError(f"{line} (nothing was written; --force writes it anyway)")
        print(f"warning: {line}", file=sys.stderr)
    s, notes, tmp = _load_checked(path, text, check)
    try:
        try:
            known = mean_of_means(s, trainer_info(s.trainer.kind))
        except ScenarioError as e:
            raise ScenarioError(str(e).replace(str(tmp), str(path))) from e
        if known is not None:  # the block is validated as the file is loaded again
            tmp.unlink()
            s, _, tmp = _load_checked(path, f"{text}\n{known.text}", lambda _s, _b: [])
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    for line in notes:
        print(line, file=sys.stderr)
    if known is not None:
        print(known.line)
    print(f"wrote {path}: {len(s.runs)} runs ({', '.join(r.name for r in s.runs)}); "
          f"run it: mlx-ddp-harness run {path}")
    return 0
