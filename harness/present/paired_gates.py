"""The paired gates' commands: ``gate --against REV SCENARIO...`` (the candidate, this checkout,
against a git revision) and ``gate --env PYTHON SCENARIO...`` (this environment against another;
the report names both environments' versions of Python and the trainers' packages), their sides
run in turns or side by side (``pair_mode``) by ``harness.run.pairs``. Speed is judged by
the sequential paired test (each run's speed: its fastest steps', ``baselines.fastest_tok_s``),
looking from ``--min-pairs`` every second pair up to ``--pairs``; losses and memory by the usual
gates, with a baseline built from the baseline side's runs. A run still undecided at ``--pairs``
is INCONCLUSIVE (``harness.judge.gates.PairedGate``): the gate then exits ``EXIT_INCONCLUSIVE``
unless another gate failed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.run.pairs import PairedRuns, interpreter, judge_paired, pairs_against, pairs_env, versions
from harness.scenario import ScenarioError


@dataclass(frozen=True)
class PairMode:
    """How a paired gate runs each pair's two sides, and why."""

    side_by_side: bool
    why: str

    def line(self) -> str:
        return f"each pair's two sides run {'side by side' if self.side_by_side else 'in turns'}: {self.why}"


def pair_mode(args: argparse.Namespace, speed_judged: bool = True, scenarios: Sequence[str] = ()) -> PairMode:
    """``--side-by-side`` or ``--in-turns`` as asked; by default side by side where speed is judged,
    every run computes on the CPU and this process can pin itself to two halves of its CPUs (the
    sides then meet the same spell of a shared machine's noise), in turns otherwise (the sides
    would share one GPU; a bisection that judges no speed reuses a commit's kept results). Where
    the runs compute: ``--device``'s choice, else each run's ``[train] device`` in ``scenarios`` as
    this checkout has them (one that cannot be read is passed over: its run says why; ``auto``
    where none can be)."""
    import os

    if args.side_by_side and args.in_turns:
        raise ScenarioError("give --side-by-side or --in-turns, not both")
    if args.side_by_side or args.in_turns:
        return PairMode(args.side_by_side, f"--{'side-by-side' if args.side_by_side else 'in-turns'} asked for it")
    if not speed_judged:
        return PairMode(False, "no speed is judged (--metrics), so a commit's kept results can be reused")
    from harness.controller.devices import DeviceRefused, plan_device
    from harness.run.sides_at_once import halves

    for run, asked in devices_asked(args, scenarios):
        try:
            device, _ = plan_device(asked)
        except DeviceRefused:  # the sides' runs say why they cannot run
            return PairMode(False, f"{run + ' asks for device ' if run else '--device '}{asked}, which MLX does "
                                   f"not see here")
        if device == "gpu":
            return PairMode(False, f"the runs compute on the GPU{f' ({run})' if run else ''}, which two sides at "
                                   f"once would share (--side-by-side runs them at once anyway)")
    try:
        split = halves()  # the split a side-by-side gate pins its sides to
    except ScenarioError:
        return PairMode(False, "the runs compute on the CPU, and this process has one CPU")
    if split is None:
        return PairMode(False, "the runs compute on the CPU, and this system cannot give each side its own half of "
                               "them (--side-by-side runs them at once, unpinned)")
    cpus = len(os.sched_getaffinity(0))
    return PairMode(True, f"the runs compute on the CPU, each side on its own half of this process's {cpus} "
                          f"CPUs (--in-turns runs them one after the other)")


def devices_asked(args: argparse.Namespace, scenarios: Sequence[str]) -> list[tuple[str, str]]:
    """(which run asks, the device it asks for) of the gate's runs: ``--device`` for every run
    (named ``""``), or each run's own (``tiny.toml's run single``)."""
    if getattr(args, "device", None):
        return [("", args.device)]
    from harness.scenario import load_scenario

    asked: list[tuple[str, str]] = []
    for path in scenarios:
        try:
            s = load_scenario(Path(path))
        except (ScenarioError, OSError):
            continue  # its runs will say what is wrong with it
        asked += [(f"{path}'s run {r.name}", s.for_run(r).train.device) for r in s.runs]
    return asked or [("", "auto")]


def run_options(args: argparse.Namespace) -> list[str]:
    """The options of ``gate`` that both sides' ``run`` takes: ``--device`` (a revision without
    it refuses the option, and its side's run fails saying so)."""
    return ["--device", args.device] if getattr(args, "device", None) else []


def sequential_design(args: argparse.Namespace) -> Any:
    """The sequential test the flags ask for (one-line errors for flags that do not fit)."""
    from harness.judge.paired import SequentialDesign

    if args.pairs < 2:
        raise ScenarioError(f"--pairs must be at least 2, got {args.pairs}")
    if not 2 <= args.min_pairs <= args.pairs:
        raise ScenarioError(f"--min-pairs must be from 2 to --pairs ({args.pairs}), got {args.min_pairs}")
    if not 0 <= args.slowdown_margin < args.detect < 100:
        raise ScenarioError(f"--slowdown-margin ({args.slowdown_margin:g}) must be below --detect ({args.detect:g}), "
                            f"from 0 to 100")
    return SequentialDesign(args.slowdown_margin / 100, args.detect / 100, args.alpha, args.beta,
                            args.min_pairs, args.pairs)


def kept_pairs(args: argparse.Namespace) -> Path | None:
    """Where ``gate --out DIR`` keeps the pairs' runs and logs: DIR/pairs."""
    return Path(args.out).resolve() / "pairs" if args.out else None  # each side runs in its own tree


def pairs_taken(args: argparse.Namespace, runs: PairedRuns) -> str:
    how = "side-by-side" if runs.side_by_side else "interleaved"
    return f"{runs.pairs} {how} pairs (sequential, {args.min_pairs} to {args.pairs})"


def cmd_gate_against(args: argparse.Namespace, overrides: dict[str, float | None]) -> int:
    """``gate --against REV``; ``overrides``: the tolerance flags given."""
    design, mode = sequential_design(args), pair_mode(args, scenarios=args.results)
    runs, commit, here = pairs_against(args.against, args.results, design, run_options(args), mode.side_by_side,
                                       kept_pairs(args))
    name = f"{args.against} ({commit[:12]}), {pairs_taken(args, runs)}"
    short = commit[:len(here.partition("+")[0])] if here else commit[:12]
    return judge_pairs(args, overrides, runs, name, [mode.line()], ((args.against, short), ("this checkout", here)))


def judge_pairs(args: argparse.Namespace, overrides: dict[str, float | None], runs: PairedRuns, name: str,
                notes: list[str], sides: Any) -> int:
    """Judge and report a paired gate (``harness.run.pairs.judge_paired``); ``sides``: each side's
    label and repository revision, for the regression table."""
    from harness.judge.baselines import Tolerances
    from harness.present.gate_report import add_fast_speeds, emit_gate, exit_code

    judged = judge_paired(runs, Tolerances().updated(**overrides), args.slowdown_margin)
    add_fast_speeds(judged.compared, runs.cand_docs)
    env = runs.cand_docs[0][1]["environment"]
    emit_gate(judged.gates, [*notes, *judged.notes], judged.compared, judged.baseline, env, name, args.format,
              args.out, sides)
    return exit_code(judged.gates)


def cmd_gate_env(args: argparse.Namespace, overrides: dict[str, float | None]) -> int:
    """``gate --env PYTHON``: the same scenarios of this checkout under another Python environment
    (the baseline) and under this one (the candidate), a pair at a time; ``overrides``: the tolerance flags."""
    design, mode = sequential_design(args), pair_mode(args, scenarios=args.results)
    other = interpreter(args.env)
    packages = tuple(args.package or ())
    base_v, cand_v = versions(other, packages), versions(sys.executable, packages)
    runs = pairs_env(other, args.results, design, run_options(args), mode.side_by_side, kept_pairs(args))
    differ = [k for k in base_v if base_v[k] != cand_v.get(k)]
    notes = [mode.line(), f"environments: baseline {other}, candidate {sys.executable}",
             *(f"{k}: {base_v[k] or 'not installed'} (baseline) vs {cand_v.get(k) or 'not installed'} (candidate)"
               for k in base_v),
             f"they differ in: {', '.join(differ)}" if differ else "their Python and packages are the same versions"]
    name = f"the environment of {args.env}, {pairs_taken(args, runs)}"
    sides = ((f"environment {args.env}", None), ("this environment", None))
    return judge_pairs(args, overrides, runs, name, notes, sides)
