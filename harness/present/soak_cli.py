"""``mlx-ddp-harness soak``: a hang rate per backend x ranks x stream.

Each cell runs gradient-shaped all-reduces (``harness.rank.soak``; one call is one
``mx.distributed.all_sum`` of one gradient-shaped array) for ``--calls`` and/or ``--minutes``,
every rank under the watchdog; a hang is recorded and the cell relaunched for its remaining calls
(``harness.controller.soak``). The table gives hangs per 1,000 calls with an exact 95 % interval
(``harness.judge.rates``), the median and p95 time per call; ``--out DIR`` writes
``DIR/soak.json`` and keeps each hung or failed launch's rank files. ``--env PYTHON`` runs the
whole soak under another Python environment, as ``gate --env`` runs its side.

Exit codes: 0 no hang, 1 a hang was counted, 2 bad input, 3 a launch failed otherwise or a
cell stopped early.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.controller.soak import STREAMS, Cell, CellResult, SoakSpec, run_cell
from harness.exit_codes import EXIT_CHECK_FAILED, EXIT_INFRA, EXIT_PASS
from harness.judge.rates import Rate, quantile
from harness.scenario import ModelSpec, ScenarioError
from harness.scenario.job import SoakJob, SoakStop
from harness.scenario.names import BACKENDS

DEFAULT_CALLS = 10000
DEFAULT_WATCHDOG_S = 20.0
HEADERS = ["Backend", "Ranks", "Stream", "Calls", "Hangs", "Hangs / 1k calls [95% CI]", "Median ms / call",
           "p95 ms / call", "Launches", "Failures", "Wall s"]


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ScenarioError(f"{what}: expected comma-separated whole numbers, got {text!r}") from e


def _names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    for n in names:
        if n not in known:
            raise ScenarioError(f"{what}: unknown {what.lstrip('-').rstrip('s')} {n!r} (one of {', '.join(known)})")
    if not names:
        raise ScenarioError(f"{what}: names none")
    return names


def _model_config(path: str) -> dict[str, Any]:
    """An mlx-lm config file, read and checked (one-line errors)."""
    p = Path(path)
    if not p.is_file():
        raise ScenarioError(f"--model {path}: no such file")
    try:
        config = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ScenarioError(f"--model {path}: not a JSON file ({e})") from e
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ScenarioError(f"--model {path}: an mlx-lm model config names its model_type")
    from harness.trainers.mlx_lm import TRAINER  # its record names mlx-lm's package

    spec = importlib.util.find_spec(str(TRAINER.package).replace("-", "_"))
    models = Path(next(iter(spec.submodule_search_locations or []), "")) / "models" if spec else None
    if models is None or not (models / f"{config['model_type']}.py").is_file():
        raise ScenarioError(f"--model {path}: mlx-lm has no architecture {config['model_type']!r} here")
    return config


def sizes(args: argparse.Namespace) -> tuple[SoakJob, str]:
    """The job's gradient shapes, and how the table names them."""
    if args.model and args.bytes is not None:
        raise ScenarioError("give --model CONFIG.json or --bytes N, not both")
    if args.bytes is not None:
        if args.bytes < 4 or args.bytes % 4:
            raise ScenarioError(f"--bytes must be a positive multiple of 4 (float32), got {args.bytes}")
        return SoakJob(shapes=((args.bytes // 4,),)), f"one float32 array of {args.bytes} bytes"
    if args.model:
        config = _model_config(args.model)
        return SoakJob(config=config), f"the trainable parameters of {args.model} ({config['model_type']})"
    from harness.data.tokenizers import ByteTokenizer

    vocab = ByteTokenizer().vocab_size
    return (SoakJob(model=ModelSpec(), vocab_size=vocab),
            f"the trainable parameters of the default suite's reference model (text_parity's tiny qwen3, "
            f"vocabulary {vocab})")


def plan(args: argparse.Namespace) -> tuple[list[Cell], SoakSpec, str]:
    """The cells, the spec and the sizes' name the options ask for (``ScenarioError`` when bad)."""
    backends = _names(args.backends, BACKENDS, "--backends")
    ranks = _ints(args.ranks, "--ranks")
    if not ranks or min(ranks) < 2:
        raise ScenarioError(f"--ranks: every rank count must be at least 2, got {args.ranks}")
    streams = _names(args.streams, STREAMS, "--streams")
    if args.calls is not None and args.calls <= 0:
        raise ScenarioError(f"--calls must be at least 1, got {args.calls}")
    if args.minutes is not None and args.minutes <= 0:
        raise ScenarioError(f"--minutes must be above 0, got {args.minutes:g}")
    if args.watchdog <= 0:
        raise ScenarioError(f"--watchdog must be above 0 seconds, got {args.watchdog:g}")
    stop = None
    if args.plant_hang:
        r, _, c = args.plant_hang.partition(":")
        if not (r.isdigit() and c.isdigit() and int(c) >= 1 and int(r) < min(ranks)):
            raise ScenarioError(f"--plant-hang: expected RANK:CALL, a rank below {min(ranks)} and a call from 1, "
                                f"got {args.plant_hang!r}")
        stop = SoakStop(int(r), int(c))
    job, label = sizes(args)
    import mlx.core as mx

    missing = [b for b in backends if not mx.distributed.is_available(b)]
    if missing:
        raise ScenarioError(f"--backends: {', '.join(missing)} not available in this MLX ({mx.__version__})")
    calls = args.calls if args.calls is not None else (None if args.minutes else DEFAULT_CALLS)
    spec = SoakSpec(job, calls, None if args.minutes is None else args.minutes * 60, args.watchdog, stop=stop)
    return [Cell(b, n, s) for b in backends for n in ranks for s in streams], spec, label


def _out(path: str | None) -> Path | None:
    if path is None:
        return None
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ScenarioError(f"{out}: --out must be a directory, and this is a file")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ScenarioError(f"{out}: --out cannot be created ({e.strerror or e})") from e
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def cell_json(r: CellResult) -> dict[str, Any]:
    """A cell's record in soak.json: what it did, its hang rate and its time per call."""
    rate = Rate(len(r.hangs), r.calls)
    return {**r.to_json(), "rate": rate.to_json(),
            "call_ms": {"median": quantile(r.call_ms, 0.5), "p95": quantile(r.call_ms, 0.95), "rounds": len(r.call_ms)}}


def table_rows(results: list[CellResult]) -> list[list[Any]]:
    return [[r.cell.backend, r.cell.ranks, r.cell.stream, r.calls, len(r.hangs), Rate(len(r.hangs), r.calls).text(),
             _ms(quantile(r.call_ms, 0.5)), _ms(quantile(r.call_ms, 0.95)), r.launches, len(r.failures),
             f"{r.wall_s:.1f}"] for r in results]


def notes(results: list[CellResult]) -> list[str]:
    """A line for each hang and failure, and for each cell that stopped early."""
    lines = []
    for r in results:
        where = f"{r.cell.backend}, {r.cell.ranks} ranks, {r.cell.stream}"
        for s in r.hangs + r.failures:
            planted = " (planted by --plant-hang)" if s.planted else ""
            what = s.line if s.kind == "hang" else s.detail
            lines.append(f"{where}: {s.kind}{planted} at call {s.at_call} (launch {s.launch}): {what}")
        if r.stopped:
            lines.append(f"{where}: {r.stopped}")
        if r.queued_s >= 1:
            lines.append(f"{where}: {r.queued_s:.1f} s of its wall time waiting for rank slots beside other launches")
    return lines


def environment() -> dict[str, Any]:
    import mlx.core as mx

    return {"python": sys.executable, "python_version": platform.python_version(), "mlx": mx.__version__,
            "platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count()}


def options(args: argparse.Namespace) -> list[str]:
    """This command's options as given, paths made absolute, without ``--env``."""
    argv = ["--backends", args.backends, "--ranks", args.ranks, "--streams", args.streams,
            "--watchdog", str(args.watchdog), "--format", args.format]
    for flag, value in (("--calls", args.calls), ("--minutes", args.minutes), ("--bytes", args.bytes),
                        ("--plant-hang", args.plant_hang)):
        if value is not None:
            argv += [flag, str(value)]
    for flag, value in (("--model", args.model), ("--out", args.out)):
        if value is not None:
            argv += [flag, str(Path(value).resolve())]
    return argv


def cmd_soak_env(args: argparse.Namespace) -> int:
    """``soak --env PYTHON``: the same soak run by another Python environment (``gate --env``'s
    interpreter and environment: without this one's ``PYTHONPATH``, ``PYTHONHOME`` and
    ``VIRTUAL_ENV``), this checkout's harness on its path."""
    from harness.run.pairs import ENVIRONMENT_VARS, interpreter, versions

    other = interpreter(args.env)
    found = versions(other)
    print(f"soak under {other}: python {found.get('python')}, mlx {found.get('mlx') or 'not installed'}",
          file=sys.stderr, flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT_VARS}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return subprocess.run([other, "-m", "harness", "soak", *options(args)], env=env).returncode


def cmd_soak(args: argparse.Namespace) -> int:
    from harness.present.tables import table

    if args.env:
        return cmd_soak_env(args)
    cells, spec, label = plan(args)
    out = _out(args.out)
    started = time.time()

    def tell(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    results: list[CellResult] = []

    def write() -> None:  # after each cell: a soak stopped later keeps what it measured
        doc = {"options": options(args), "date": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(started)),
               "environment": environment(), "sizes": label, "calls_per_cell": spec.calls,
               "seconds_per_cell": spec.seconds, "watchdog_s": spec.watchdog_s,
               "cells": [cell_json(r) for r in results]}
        (out / "soak.json").write_text(json.dumps(doc, indent=1) + "\n")

    for cell in cells:
        results.append(run_cell(cell, spec, None if out is None else out / "launches", tell))
        if out is not None:
            write()
    arrays = next((r for r in results if r.arrays), None)
    shape = (f": {arrays.arrays} array{'' if arrays.arrays == 1 else 's'}, {arrays.round_bytes} bytes a round"
             if arrays else "")
    print(f"gradient shapes: {label}{shape}; one call = one all_sum of one of them")
    print(table(table_rows(results), HEADERS, args.format))
    for line in notes(results):
        print(line)
    if out is not None:
        print(f"wrote {out / 'soak.json'}", file=sys.stderr)
    if any(r.failures or r.stopped for r in results):
        return EXIT_INFRA
    return EXIT_CHECK_FAILED if any(r.hangs for r in results) else EXIT_PASS


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("soak", help="hangs per 1,000 gradient-shaped all-reduces, per backend x ranks x stream",
                       description="Run gradient-shaped all-reduces (one call: one mx.distributed.all_sum of one "
                                   "gradient-shaped array) across backends x ranks x stream, every rank under the "
                                   "watchdog, and report hangs per 1,000 calls with an exact 95% interval and the "
                                   "time per call. Exit 0 no hang, 1 a hang, 2 bad input, 3 another failure.")
    s.add_argument("--model", metavar="CONFIG.json",
                   help="an mlx-lm model config: one call per trainable parameter array, float32 (default: the "
                        "default suite's reference model, text_parity's tiny qwen3)")
    s.add_argument("--bytes", type=int, metavar="N", help="instead: one float32 array of N bytes")
    s.add_argument("--backends", default="ring", help="comma-separated: ring, jaccl, nccl, mpi (default ring)")
    s.add_argument("--ranks", default="2,3,4", help="comma-separated rank counts, each at least 2 (default 2,3,4)")
    s.add_argument("--streams", default="cpu,default",
                   help="cpu (all_sum(..., stream=mx.cpu)) and/or default (no stream) (default both)")
    s.add_argument("--calls", type=int, metavar="N",
                   help=f"calls per cell (default {DEFAULT_CALLS}, or none with --minutes alone)")
    s.add_argument("--minutes", type=float, metavar="M", help="time limit per cell; with --calls, whichever is first")
    s.add_argument("--watchdog", type=float, default=DEFAULT_WATCHDOG_S, metavar="S",
                   help=f"seconds without progress before a launch is a hang (default {DEFAULT_WATCHDOG_S:g})")
    s.add_argument("--env", metavar="PYTHON",
                   help="run the soak under this Python environment (an interpreter, or tox:NAME), as gate --env")
    s.add_argument("--plant-hang", metavar="RANK:CALL",
                   help="rank RANK stops itself (SIGSTOP) at call CALL of each cell, once: proves detection")
    s.add_argument("--format", choices=("plain", "github"), default="plain", help="table format")
    s.add_argument("--out", metavar="DIR", help="write DIR/soak.json and keep hung launches' rank files")
    s.set_defaults(func=cmd_soak)
