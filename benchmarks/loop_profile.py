"""Where a harnessed rank's time goes inside its trainer's loop: the harness side of
``observer_effect.py`` run once under py-spy (sampling every thread of every process, idle ones
too), and the samples of its rank read back. It reports the share of the trainer's loop spent in
the harness's own frames (its callbacks, its batch wrapper, the ledger's interposition: each
sample where a frame of ``harness/`` lies deeper than the loop's), the part of that spent while
``mx.compile`` traced the step (once, not per step), the harness frames that took most (and,
out of tracing, the deepest frame each such sample was in), and how often the rank's other
threads (the memory sampler's) were doing anything at all. What a GPU's
step loses to host work the harness adds shows here as it would on any device: the loop waits in
the trainer's evaluation either way.

    python benchmarks/loop_profile.py --model cpu3m --trainer mlx_lm --steps 200

It needs py-spy (``pip install py-spy``); ``--raw FILE`` keeps the samples (py-spy's raw format),
and ``--read FILE`` reports a kept file again without running anything.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from observer_effect import MODELS, TAKE_TURNS, scenario_text  # noqa: E402

OBSERVER = Path(__file__).with_name("observer_effect.py")
RANK = "harness.rank"  # in a rank process's command line
TRACING = "Ledger.compile.<locals>.traced"  # mx.compile tracing the step through the ledger's wrapper
WAITS = ("wait (threading.py", "select (selectors.py", "sleep", "_wait_for_tstate_lock")
LEDGER = Path(__file__).resolve().parents[1] / "harness" / "rank" / "ledger.py"
# the ledger's lines that call what it wraps (the compiled step, a collective): the trainer's own work
WRAPPED_CALLS = ("compiled(*a, **kw)", "_original(*args, **kwargs)")
SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "ddp_train.py"
# the frame of each trainer's loop, as py-spy names it: what lies deeper is the loop's time
LOOPS = {"mlx_lm": "train (mlx_lm/tuner/trainer.py:", "unsloth_zoo": "MLXTrainer._train_inner (unsloth_zoo/",
         "script": "main (ddp_train.py:"}


def script_loop(path: Path = SCRIPT) -> range:
    """The lines of the script's ``main`` that its loop of steps spans (from ``for step`` to
    ``run.finish``, left out): its model and rows are built before them."""
    lines = path.read_text().splitlines()
    first = next(n for n, line in enumerate(lines, 1) if line.strip().startswith("for step in"))
    return range(first, next(n for n, line in enumerate(lines, 1) if "run.finish(" in line))


def in_loop(frame: str, trainer: str, loop: range | None) -> bool:
    """Whether ``frame`` is ``trainer``'s loop (the script's: its ``main`` at a line of ``loop``)."""
    if LOOPS[trainer] not in frame:
        return False
    return loop is None or int(frame.rsplit(":", 1)[1].rstrip(")")) in loop


def wrapped_lines(path: Path = LEDGER) -> set[str]:
    """``file:line`` of each line of the ledger that calls what it wraps, as py-spy names frames."""
    return {f"harness/rank/ledger.py:{n}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if any(c in line for c in WRAPPED_CALLS)}


@dataclass
class LoopShare:
    """A rank's samples: in the trainer's loop, those in harness frames (and while tracing), the
    harness frames by count (and, out of tracing, the deepest frame of each such sample), those
    in a call the ledger wraps (the trainer's own work), and the samples of the rank's other
    threads that were not waiting."""

    samples: int = 0
    loop: int = 0
    wrapped: int = 0
    harness: int = 0
    tracing: int = 0
    frames: Counter[str] = field(default_factory=Counter)
    deepest: Counter[str] = field(default_factory=Counter)  # out of tracing: the frame each sample was in
    threads_busy: int = 0
    threads: int = 0


def read_raw(lines: list[str], trainer: str, wrapped: set[str] | None = None) -> LoopShare:
    """``py-spy record --format raw --threads --subprocesses`` lines (``frame;frame;... count``,
    outermost first) read for ``trainer``'s loop; a sample whose deepest harness frame is at one
    of ``wrapped`` (``wrapped_lines``) is the wrapped call's."""
    out = LoopShare()
    wrapped = wrapped_lines() if wrapped is None else wrapped
    loop = script_loop() if trainer == "script" else None
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        if not any(f.startswith("process ") and RANK in f for f in frames):
            continue
        out.samples += n
        at = next((i for i, f in enumerate(frames) if in_loop(f, trainer, loop)), None)
        if at is None:
            main = any("harness/rank/__main__.py" in f for f in frames)
            if not main:  # another thread of the rank: the memory sampler's, the reporter's
                out.threads += n
                out.threads_busy += n if not any(w in frames[-1] for w in WAITS) else 0
            continue
        out.loop += n
        own = [f for f in frames[at + 1:] if " (harness/" in f]
        if own and any(f"({w})" in own[-1] for w in wrapped):
            out.wrapped += n
        elif own:
            out.harness += n
            out.frames[own[0]] += n
            if any(TRACING in f for f in frames):
                out.tracing += n
            else:
                out.deepest[frames[-1]] += n
    return out


def report(share: LoopShare, trainer: str) -> str:
    if not share.loop:
        return f"no samples in {trainer}'s loop ({LOOPS[trainer]}...): did its rank train?"
    pct = 100 * share.harness / share.loop
    lines = [f"{trainer}: {share.samples} samples of the rank, {share.loop} in the trainer's loop; in the harness's "
             f"frames {share.harness} ({pct:.2f} %), {share.tracing} of them while mx.compile traced the step "
             f"(once); {share.wrapped} in the calls the ledger wraps (the step, a collective: the trainer's own "
             f"work); the rank's other threads busy in {share.threads_busy} of their {share.threads}"]
    lines += [f"  {n:6d}  {frame}" for frame, n in share.frames.most_common(5)]
    if share.deepest:
        lines.append("the deepest frames of those out of tracing (where the time went inside them):")
        lines += [f"  {n:6d}  {frame}" for frame, n in share.deepest.most_common(5)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="cpu3m")
    p.add_argument("--trainer", choices=sorted(TAKE_TURNS & LOOPS.keys()), default="mlx_lm")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rate", type=int, default=200, help="samples a second (py-spy's --rate)")
    p.add_argument("--raw", type=Path, help="keep py-spy's samples in this file")
    p.add_argument("--read", type=Path, help="report this kept file again (runs nothing)")
    a = p.parse_args()
    if a.read is not None:
        try:
            lines = a.read.read_text().splitlines()
        except OSError as e:
            raise SystemExit(f"--read {a.read}: {e.strerror or e}") from None
        print(report(read_raw(lines, a.trainer), a.trainer))
        return
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    if a.steps < 2:
        raise SystemExit(f"--steps must be at least 2, got {a.steps}")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (scenario := d / "loop_profile.toml").write_text(scenario_text(a.model, [a.trainer], a.steps))
        raw = a.raw or d / "samples.raw"
        cmd = [spy, "record", "--subprocesses", "--idle", "--threads", "--rate", str(a.rate), "--format", "raw",
               "-o", str(raw), "--", sys.executable, str(OBSERVER), "--harnessed", str(scenario), a.trainer,
               str(d / "marks.json")]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not raw.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SystemExit(f"py-spy or the harness side failed ({done.returncode}): {tail[0]}")
        print(report(read_raw(raw.read_text().splitlines(), a.trainer), a.trainer))


if __name__ == "__main__":
    main()
