"""Command line: ``mlx-ddp-harness run | report | gate | baseline update | list | doctor``.

Exit codes are the help's (``EXIT_CODES``).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from harness import ablation
from harness.exit_codes import EXIT_BAD_INPUT, EXIT_INFRA, EXIT_INTERNAL, internal_fault
from harness.judge.baselines import BaselineError
from harness.memory.plan import BUDGET_VAR, parse_size
from harness.present import soak_cli, starter
from harness.present.baseline_cli import add_parsers
from harness.present.live import MODES, PLAIN_EVERY_S, PlainProgress, progress_display
from harness.run.pipeline import available, prepare, run_repeats
from harness.run.results import load_results
from harness.scenario import Scenario, ScenarioError, discover, load_scenario, with_device
from harness.scenario.availability import runnable
from harness.scenario.names import DEVICES

if TYPE_CHECKING:
    from harness.cluster_spec import Cluster


def default_scenario_dir() -> Path:
    """``./scenarios`` when it exists, else the scenarios shipped beside the package."""
    here = Path.cwd() / "scenarios"
    return here if here.is_dir() else Path(__file__).resolve().parents[2] / "scenarios"


def resolve_scenarios(paths: list[str], notes: list[str] | None = None, every: bool = False,
                      left_out: list[str] | None = None) -> list[Scenario]:
    """Files are taken as given; a directory (or nothing: the default dir) gives its default set
    (``default = true``), or with ``every`` its full set (``full = true``, every default one too).
    ``notes`` gets a line for what a directory leaves out, and for the shipped suite taken for want
    of a ``./scenarios``; ``left_out`` the files of the full set left out."""
    notes = [] if notes is None else notes
    left_out = [] if left_out is None else left_out
    if not paths:
        paths = [str(default_scenario_dir())]
        if not (Path.cwd() / "scenarios").is_dir():
            notes.append(f"no ./scenarios here: running the harness's own default suite ({paths[0]})")
    out: list[Scenario] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = [(f, load_scenario(f)) for f in discover(p)]
            chosen = [s for _, s in found if (s.full if every else s.default)]
            if not chosen:
                raise ScenarioError(f"{p}: no scenario with {'full' if every else 'default'} = true")
            left = [(f.name, s.full) for f, s in found if not any(s is c for c in chosen)]
            in_full = [name for name, full in left if full]
            by_name = [name for name, full in left if not full]
            if in_full:
                notes.append(f"{p}: not in the default set (--all runs the full set): {', '.join(in_full)}")
            if by_name:
                notes.append(f"{p}: run only when named: {', '.join(by_name)}")
            left_out.extend(in_full)
            out.extend(chosen)
        else:
            out.append(load_scenario(p))
    names = [s.name for s in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise ScenarioError(f"scenario name {dup!r} is used by more than one file")
    return out


def cluster_of(args: argparse.Namespace, scenarios: list[Scenario]) -> Cluster | None:
    """The hosts of ``--hostfile``, else of the scenarios' ``[cluster]`` sections (one cluster per
    invocation), checked: every host reachable, with this controller's harness and MLX."""
    from harness.cluster_spec import ClusterError, from_mapping, load_hostfile
    from harness.controller.host_checks import check_hosts

    try:
        if args.hostfile:
            cluster = load_hostfile(args.hostfile)
        else:
            found = [(s, s.cluster) for s in scenarios if s.cluster]
            if not found:
                return None
            if any(c != found[0][1] for _, c in found):
                raise ScenarioError("scenarios name different [cluster] sections; run them separately")
            s0 = found[0][0]
            cluster = from_mapping(found[0][1], f"{s0.path}: [cluster]", Path(str(s0.path)).parent)
        problems = [c.problem for c in check_hosts(cluster) if c.problem]
    except ClusterError as e:
        raise ScenarioError(str(e)) from e
    if problems:
        raise ScenarioError(problems[0])
    return cluster


def _check_out(out: Path | None) -> None:
    """``--out`` must be a directory this process can write, or one it can create: refused before
    anything runs (a suite's results are written only at its end)."""
    if out is None:
        return
    if out.exists() and not out.is_dir():
        raise ScenarioError(f"{out}: --out must be a directory, and this is a file")
    base = out
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ScenarioError(f"{out}: --out cannot be created: {base} is a file")
    try:
        tempfile.TemporaryDirectory(dir=base, prefix=".mlx-ddp-harness-probe-").cleanup()
    except OSError as e:
        raise ScenarioError(f"{out}: --out cannot be written ({e.strerror or e} in {base})") from e


def slow_blas_notes() -> list[str]:
    """A line for the top of a run whose ranks will use the mlx-cpu wheel's slow reference BLAS."""
    from harness.controller.environment import blas_info

    blas = blas_info()
    return [f"note: ranks will use the {blas['blas']}: {blas['fix']}"] if blas["slow"] else []


def cmd_run(args: argparse.Namespace) -> int:
    from harness.controller.ports import PortError
    from harness.controller.run_job import LaunchError
    from harness.present.report import summary_lines, write_outputs
    from harness.present.tables import scenario_text
    from harness.run.results import document

    if args.memory_budget is not None:  # shared with every launch of this run and its children
        try:
            os.environ[BUDGET_VAR] = str(parse_size(args.memory_budget))
        except ValueError as e:
            raise ScenarioError(f"--memory-budget: {e}") from None
    notes: list[str] = slow_blas_notes()
    left_out: list[str] = []
    scenarios, skipped = available(resolve_scenarios(args.scenarios, notes, args.all, left_out))
    scenarios = [with_device(s, args.device) for s in scenarios]
    cluster = cluster_of(args, scenarios)
    plans, more = prepare(scenarios, args.backend, cluster)
    for line in notes + more:
        print(line, file=sys.stderr)
    out = Path(args.out) if args.out else None
    _check_out(out)
    if args.repeat < 1:
        raise ScenarioError(f"--repeat must be at least 1, got {args.repeat}")
    if args.keep_checkpoints and out is None:
        raise ScenarioError("--keep-checkpoints needs --out (the checkpoints go under OUT/runs)")

    def finished(run):  # noqa: ANN001 - one line as each run ends
        status = "ok" if run.ok else "FAILED"
        print(f"  run {run.name} (world size {run.world_size}): {status} in {run.watch.wall_s:.1f}s",
              file=sys.stderr, flush=True)

    if args.progress_every <= 0:
        raise ScenarioError(f"--progress-every must be above 0 seconds, got {args.progress_every:g}")
    display = progress_display(args.progress)
    if isinstance(display, PlainProgress):
        display.every_s = args.progress_every
    summaries = []
    try:
        with display or contextlib.nullcontext():
            for plan in plans:
                def starting(k: int, s: Scenario = plan.scenario) -> None:
                    of = f", repeat {k} of {args.repeat}" if args.repeat > 1 else ""
                    print(f"scenario {s.name} ({s.path}{of})", file=sys.stderr, flush=True)

                summary = run_repeats(plan, args.repeat, out, starting, on_run=finished, backend=args.backend,
                                      progress=display, keep_checkpoints=args.keep_checkpoints, cluster=cluster)
                summaries.append(summary)
                print(scenario_text(summary, args.format) + "\n", flush=True)
    except (LaunchError, PortError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INFRA
    for s in skipped:
        print(s.line(), flush=True)
    doc = document(summaries, [s.to_json() for s in skipped])
    if out is not None:
        for f in write_outputs(out, doc, args.plots):
            print(f"wrote {f}", file=sys.stderr)
    lines = summary_lines(doc, out)
    if left_out:
        lines.append(f"ran the default set: {len(scenarios)} of the {len(scenarios) + len(left_out)} scenarios of "
                     f"the full set; --all runs them all")
    print("\n".join(lines), flush=True)
    return doc["exit_code"]


def cmd_report(args: argparse.Namespace) -> int:
    """Print the tables of saved results without running anything."""
    from harness.present.report import summary_lines
    from harness.present.tables import scenario_text

    for f, doc in load_results(args.results):
        print(f"{f}: {'PASSED' if doc.get('passed') else 'FAILED'}\n")
        for s in doc["scenarios"]:
            print(scenario_text(s, args.format) + "\n")
        if "exit_code" in doc:
            print("\n".join(summary_lines(doc, f.parent if (f.parent / "report.md").exists() else None)) + "\n")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from harness.scenario.availability import missing
    from harness.scenario.trainers import trainers

    directory = Path(args.directory) if args.directory else default_scenario_dir()
    if not directory.is_dir():
        raise ScenarioError(f"{directory}: not a directory")
    rows, skipped = [], []
    for f in discover(directory):
        s = load_scenario(f)
        sizes = ", ".join(str(r.world_size) for r in s.runs)
        why = runnable(s)[1]
        skipped += [why] if why is not None else []
        which = "default" if s.default else "full" if s.full else ""
        if why is not None:
            which = f"{which} (skips {'all' if why.whole else ', '.join(why.runs)})".strip()
        rows.append([s.name, f.name, which, sizes, s.description])
    print(tabulate(rows, headers=["Scenario", "File", "Set", "World sizes", "Description"]))
    for reason in sorted({s.reason for s in skipped}):
        print(f"skipped here: {reason}")
    print()
    print(tabulate([[info.kind, info.title, missing(info.kind) or "yes"] for info in trainers().values()],
                   headers=["Trainer", "What it is", "Runs here"]))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from harness.present import doctor

    if args.hostfile:
        from harness.cluster_spec import ClusterError, load_hostfile

        try:
            cluster = load_hostfile(args.hostfile)
        except ClusterError as e:
            raise ScenarioError(str(e)) from e
        rows = doctor.cluster_checks(cluster)
        print(doctor.render(rows))
        return 0 if all(ok for _, _, ok in rows) else 1
    rows = doctor.checks()
    print(doctor.render(rows))
    essential = {"distributed backends", "default backend", "loopback ports"}
    return 0 if all(ok for what, _, ok in rows if what in essential) else 1


DESCRIPTION = ("Runs DDP training scenarios under mlx.launch with real MLX ranks and judges them: N ranks "
               "against one process, resumed against uninterrupted runs, memory ceilings and speed.")
EXIT_CODES = """exit codes of run:
  0  every check passed
  1  a check failed
  2  bad input: one line naming the file, key or value, before anything starts
  3  a run did not complete: a rank crashed or hung, or the launch failed
  4  inconclusive: no check failed, but a parity check had no power (its limit more than half of
     what training moved); its line says why and what would give it power
report exits 0; gate 1 on a regression, 4 when inconclusive (no gate failed, but a paired speed
test reached --pairs undecided, rerun with more pairs; or a check failed in some of the candidate's
runs only, or was not judged there: its line says which); doctor 1 when an
essential check fails; any command exits 2 on bad input and 5 on a fault in the harness itself
(its traceback on stderr: a bug to report, never a verdict).
every command and option: docs/commands.md"""


def parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="mlx-ddp-harness", description=DESCRIPTION, epilog=EXIT_CODES,
                                formatter_class=formatter)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run scenarios (default: the default set in scenarios/)",
                         description="Run scenarios, print their tables and a summary.", epilog=EXIT_CODES,
                         formatter_class=formatter)
    run.add_argument("scenarios", nargs="*", help="scenario files or directories")
    run.add_argument("--out", help="directory for result.json, report.md and rank logs")
    run.add_argument("--all", action="store_true",
                     help="a directory runs its full set (full = true), not only its default set (default = true)")
    run.add_argument("--format", choices=("plain", "github"), default="plain", help="table format")
    run.add_argument("--repeat", type=int, default=1, metavar="N",
                     help="run each scenario N times; result.json keeps every repeat's figures (for baselines)")
    run.add_argument("--backend", choices=("ring", "nccl", "mpi", "jaccl"),
                     help="distributed backend of every run that names none (default: nccl with CUDA, else ring)")
    run.add_argument("--device", choices=DEVICES,
                     help="the device of every run, over the scenarios' [train] device (auto: the GPU where MLX "
                          "sees a real one, else the CPU)")
    run.add_argument("--progress", choices=MODES, default="auto",
                     help="progress while runs run: a live display on a terminal, plain lines otherwise (auto)")
    run.add_argument("--progress-every", type=float, default=PLAIN_EVERY_S, metavar="S",
                     help=f"seconds between a run's plain progress lines (default {PLAIN_EVERY_S:g})")
    run.add_argument("--hostfile", metavar="FILE",
                     help="run every multi-rank run across these hosts (mlx.launch's hostfile format, over SSH)")
    run.add_argument("--keep-checkpoints", action="store_true",
                     help="keep whole checkpoints under OUT/runs (default: their manifests and trainer state)")
    run.add_argument("--memory-budget", metavar="SIZE",
                     help=f"memory every launch on this machine shares, e.g. 6GB or 512MB ({BUDGET_VAR}; "
                          "default: the working set); each rank's share is it / the ranks on its host")
    run.add_argument("--plots", action=argparse.BooleanOptionalAction, default=None,
                     help="draw report.md's plots under OUT/plots (default: on, unless MLX_DDP_HARNESS_PLOTS=off)")
    run.set_defaults(func=cmd_run)
    rep = sub.add_parser("report", help="print the tables of saved results (result.json files or --out dirs)")
    rep.add_argument("results", nargs="+", help="result.json files or directories holding one")
    rep.add_argument("--format", choices=("plain", "github"), default="plain", help="table format")
    rep.set_defaults(func=cmd_report)
    ls = sub.add_parser("list", help="list scenarios")
    ls.add_argument("directory", nargs="?", help="scenario directory (default: scenarios/)")
    ls.set_defaults(func=cmd_list)
    doc = sub.add_parser("doctor", help="check mlx, backends, ports and BLAS on this machine (or a cluster's hosts)")
    doc.add_argument("--hostfile", metavar="FILE",
                     help="check these hosts instead: SSH, versions, backends, all-reduce bandwidth between them")
    doc.set_defaults(func=cmd_doctor)
    add_parsers(sub)
    soak_cli.add_parser(sub)
    starter.add_parser(sub, lambda s, backend: prepare([s], backend)[1])
    return p


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the controller, which kills its ranks


LAUNCHING = ("run", "gate", "soak", "doctor")  # commands that start ranks


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminated)
    if hasattr(signal, "SIGUSR1") and sys.__stderr__ is not None:  # ``kill -USR1 PID``: where the controller is
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    try:
        args = parser().parse_args(argv)  # argparse's own errors exit 2 (SystemExit); a fault here is 5
        if args.command in LAUNCHING:
            refused = ablation.refuse(f"mlx-ddp-harness {args.command}")
            if refused:
                raise ScenarioError(refused)
        return args.func(args)
    except (ScenarioError, BaselineError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INTERNAL if getattr(e, "internal", False) else EXIT_BAD_INPUT  # a gate side's run faulted
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (``report DIR | head``): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except Exception as e:  # a bug here must not exit 1, which reads as "a check failed"
        return internal_fault(e)
