"""The reference trainer's eager step beside mlx-lm's bare step, at one and two ranks, and what in
the reference costs the gradient all-reduce's overlap.

    python benchmarks/reference_overlap.py [--variants A,B,...] [--steps N] [--turns T]     # one rank
    mlx.launch --backend nccl -n 2 -- python benchmarks/reference_overlap.py [...]           # two ranks
    ... reference_overlap.py --check [--variants ...]    # same values as the reference? (any device)
    python benchmarks/reference_overlap.py --harness R    # whole harness runs, as is and proposed

Every variant trains the model of ``step_vs_mlx_lm.py --model`` (default gpu044b: qwen3 0.44B,
bfloat16, 8 rows x 1024 inputs per rank, every token a target) from the same parameters, each for
``--steps`` steps in turn in the same processes, ``--turns`` times round; rank 0 prints per turn
the median ms of steps 4..N of the step, its host build (from the step's start until ``mx.eval``
of the step is called) and its evaluation (``mx.eval`` and reading the loss back), and the host
time of the build's parts (``grad``: the micro-batch's lazy gradient, ``agree``, ``loss``,
``reduce``, ``update``, ``arrays``: the batch to MLX, ``start``/``sched``: the proposal's
``mx.async_eval`` calls, which block the host while MLX's CUDA backend encodes). The process
is set up as a rank of the harness is: the collective ledger installed and the memory sampler
running (``--bare-process``: neither). Variants:

- ``loop``: mlx-lm's bare eager step (``harness.rank.anchor``: ``default_loss``,
  ``nn.average_gradients``, the update, one ``mx.eval``), its batch made once;
- ``rev``: the same, its gradients all-reduced in 64 MiB buckets taken from the last layer back
  and handed to ``mx.async_eval`` before the update (``allreduce_overlap.py``'s ``rev_order``);
- ``loop-sched``: ``nn.average_gradients``'s own buckets, the reduced gradients handed to
  ``mx.async_eval`` last parameter first;
- ``ref``: the reference trainer's step as it is (``Trainer.train_step`` from the harness, after
  the fetch's agreement on the token count, as ``Trainer.run`` calls it; its step bookkeeping
  (``_record``'s events, memory and callbacks) outside the timed step, as there);
- ``ref-agree``: without the agreement inside the step (``local_step``'s ``coord.agree``);
- ``ref-loss``: the logged loss without its all-sum (local sum / T: wrong, a diagnostic);
- ``ref-ledger``: no collective ledger during the turn; ``ref-sampler``: no memory sampler;
- ``ref-arrays``: the batch's arrays made once; ``ref-noagree``: neither agreement (fetch, step);
- ``loop-agree``: ``loop`` with the reference's two agreements (before and after the gradient);
- ``sched64``: the scheme tried before in ``Semantics.reduce``: 64 MiB buckets last layer first,
  handed to ``mx.async_eval`` (different buckets from ``nn.average_gradients``);
- ``sched``: the reference with the reduced gradients (``nn.average_gradients``'s buckets, the
  reduce unchanged) handed to ``mx.async_eval`` last parameter first, where the world has more
  than one rank and MLX computes on a GPU (``Proposed.schedule``);
- ``fwd``: the reference with the local forward (the token-loss sum) handed to ``mx.async_eval``
  once every rank agreed that it built its step, on a GPU (``Proposed.start``): what the
  reference now does itself (``start_forward`` in ``harness/trainers/reference/step.py``);
- ``new``: ``sched`` and ``fwd`` together;
- ``nofwd``: the reference's step as it was before ``start_forward``.

What was seen on two H100s (MLX 0.32.4, ``MLX_DISABLE_COMPILE=1``, TF32 at MLX's default): the
reference's own pieces (both agreements, the loss's all-sum, the batch's arrays, the ledger, the
memory sampler) cost at most a few ms each, within the turns' spread; ``sched``, ``sched64`` and
``new`` were not faster than ``ref`` at two ranks; ``fwd`` shortened the harness's eager step by
17 ms at one rank and 13 ms at two (medians of 3 runs each), so its scaling fell. An
``mx.async_eval`` of a whole backward holds the host 80-130 ms while MLX's CUDA backend encodes
it, and that backend records the NCCL all-reduce into the compute stream's graph (upstream
``AllReduce::eval_gpu``), so reordering the buckets most likely gives back host time rather than
running the all-reduce beside the backward. ``--pin`` (each rank on its own half of the cores)
was no faster.

The figures above (and in docs/gpu.md) were taken before ``start_forward`` landed, ``ref`` then
being today's ``nofwd``: since then ``ref`` (and ``--harness``'s runs "as they are") start their
forward as ``fwd`` does, and ``--proposed nofwd`` (the default) runs the step before it beside.

``--check`` trains ``ref`` and every other reference variant 3 steps each from the same
parameters and a fresh optimizer, and compares the parameters, the optimizer state and the logged
losses with ``ref``'s, bit for bit.

``--harness R``: the eager reference runs of ``step_vs_mlx_lm.py`` (``ws1_eager``, ``ws2_eager``,
launched by the harness under ``MLX_DISABLE_COMPILE=1``), as they are and with a proposal
(``--proposed``: some of ``new``, ``sched``, ``fwd``, ``nofwd``) installed in every rank (through a
``sitecustomize`` on the ranks' ``PYTHONPATH``; ``installed`` counts the processes it patched),
alternating, ``R`` times; prints each run's post-step-1 median tok/s and phases, and each
repeat's scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

PATCH_VAR = "REFERENCE_OVERLAP_PROPOSED"

from overlap_bench import LOOPS, Bench  # noqa: E402 - after the paths above
from overlap_variants import proposals  # noqa: E402


def summary(rows: list[dict[str, float]], skip: int = 3) -> dict[str, float]:
    kept = rows[skip:] if len(rows) > skip else rows
    keys = ["fetch", "build", "eval", "step", *sorted({k for r in kept for k in r if k.startswith("p_")})]
    out = {k: round(statistics.median(r.get(k, 0.0) for r in kept) * 1e3, 2) for k in keys}
    steps = sorted(r["step"] for r in kept)
    out["p25"] = round(steps[len(steps) // 4] * 1e3, 2)
    out["p75"] = round(steps[(3 * len(steps)) // 4] * 1e3, 2)
    return out


def device_name() -> str:
    import mlx.core as mx

    try:
        return str(mx.device_info().get("device_name", mx.default_device()))
    except Exception:  # noqa: BLE001 - a name only
        return str(mx.default_device())


def bench(args: argparse.Namespace) -> None:
    import mlx.core as mx

    b = Bench(args.model, args.steps, args.bare_process)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(b.classes) - set(LOOPS)
    if unknown:
        raise SystemExit(f"unknown variants: {sorted(unknown)}")
    if b.rank == 0:
        print(json.dumps({"world_size": b.n, "device": str(mx.default_device()),
                          "device_name": device_name(),
                          "mlx": mx.__version__, "disable_compile": os.environ.get("MLX_DISABLE_COMPILE"),
                          "tf32": os.environ.get("MLX_ENABLE_TF32", "default"), "ledger_and_sampler": not b.proc.bare,
                          "steps": args.steps, "turns": args.turns}), flush=True)
    got: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for turn in range(args.turns):
        order = variants if turn % 2 == 0 else variants[::-1]  # each variant's turns sit early and late
        for v in order:
            s = summary(b.turn(v, args.steps))
            got[v].append(s)
            if b.rank == 0:
                print(json.dumps({"world_size": b.n, "turn": turn + 1, "variant": v, **s}), flush=True)
    if b.rank == 0:
        print(f"summary, world size {b.n}: median ms of steps 4-{args.steps} per turn")
        for v in variants:
            steps = [s["step"] for s in got[v]]
            builds = [s["build"] for s in got[v]]
            evals = [s["eval"] for s in got[v]]
            print(f"  {v:12s} step {statistics.median(steps):7.2f} (turns {min(steps):.2f}-{max(steps):.2f})  "
                  f"build {statistics.median(builds):6.2f}  eval {statistics.median(evals):7.2f}  "
                  f"fetch {statistics.median(s['fetch'] for s in got[v]):5.2f}  " + "  ".join(
                      f"{k[2:]} {statistics.median(s.get(k, 0.0) for s in got[v]):.2f}"
                      for k in sorted({k for s in got[v] for k in s if k.startswith("p_")})), flush=True)


def check(args: argparse.Namespace) -> None:
    """Every reference variant's parameters, optimizer state and losses after 3 steps against ``ref``'s."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    b = Bench(args.model, 3, True)
    variants = [v for v in args.variants.split(",") if v and v in b.classes and v != "ref"]

    def run(v: str) -> tuple[dict[str, Any], dict[str, Any], list[float]]:
        b.restore()
        _, losses, opt = b.reference_steps(v, 3)
        params = dict(tree_flatten(b.model.parameters()))
        state = dict(tree_flatten(opt.state))
        mx.eval(params, state)
        return params, state, losses

    p0, s0, l0 = run("ref")
    for v in variants:
        p, s, losses = run(v)
        same_p = p.keys() == p0.keys() and all(mx.array_equal(p[k], p0[k]).item() for k in p0)
        same_s = s.keys() == s0.keys() and all(mx.array_equal(s[k], s0[k]).item() for k in s0)
        diff = max(float(mx.abs(p[k].astype(mx.float32) - p0[k].astype(mx.float32)).max().item()) for k in p0)
        if b.rank == 0:
            print(json.dumps({"world_size": b.n, "device": str(mx.default_device()), "variant": v,
                              "params_equal": same_p, "optimizer_state_equal": same_s, "max_abs_param_diff": diff,
                              "losses_equal": losses == l0, "losses": losses, "ref_losses": l0}), flush=True)
    b.restore()


# -- whole runs through the harness ---------------------------------------------------------------

SITE = """import os
if os.environ.get({var!r}, "as_is") != "as_is":
    import sys
    sys.path[:0] = [{root!r}, {here!r}]
    import overlap_variants
    overlap_variants.install(os.environ[{var!r}])
    open(os.path.join({marks!r}, str(os.getpid())), "w").close()
"""


def harness_runs(args: argparse.Namespace) -> None:
    import step_vs_mlx_lm as svm

    from harness.scenario import load_scenario
    from harness.scenario.plan import job_for

    site = Path(tempfile.mkdtemp(prefix="refov-site-"))
    marks = site / "installed"
    marks.mkdir()
    (site / "sitecustomize.py").write_text(SITE.format(var=PATCH_VAR, root=str(ROOT), here=str(HERE), marks=str(marks)))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "step_vs_mlx_lm.toml"
        path.write_text(svm.scenario_text(args.model, [1, 2], args.steps))
        s = load_scenario(path)
    specs = {n: s.run(f"ws{n}_eager") for n in (1, 2)}
    tok: dict[tuple[str, int], list[float]] = {}
    whos = ["as_is", *(w for w in args.proposed.split(",") if w)]
    unknown = set(whos[1:]) - set(proposals())
    if unknown:
        raise SystemExit(f"unknown proposals: {sorted(unknown)}")
    for r in range(args.harness):
        order = [(w, n) for w in (whos if r % 2 == 0 else whos[::-1]) for n in (1, 2)]
        for who, n in order:
            os.environ[PATCH_VAR] = who
            before = len(list(marks.iterdir()))
            spec = specs[n]
            with svm.compile_disabled(True):
                value, result = svm.measure(spec, job_for(s, spec.name), args.backend)
            tok.setdefault((who, n), []).append(value)
            ph = {k: round(v * 1e3, 2) for k, v in result.get("phase_medians_s", {}).items()}
            print(json.dumps({"repeat": r + 1, "who": who, "world_size": n, "tok_s": round(value),
                              "step_ms_post_step1_median": round(result["tokens_global_per_step"][0] / value * 1e3, 2),
                              "phases_ms": ph, "device": result.get("device"),
                              "installed": len(list(marks.iterdir())) - before}), flush=True)
    os.environ[PATCH_VAR] = "as_is"
    for who in whos:
        one, two = tok[(who, 1)], tok[(who, 2)]
        pairs = [b / a for a, b in zip(one, two, strict=True)]
        print(f"{who}: tok/s 1 GPU {[round(x) for x in one]}, 2 GPUs {[round(x) for x in two]}; "
              f"scaling best/best {max(two) / max(one):.3f}x, per repeat {[round(p, 3) for p in pairs]} "
              f"(median {statistics.median(pairs):.3f}x)", flush=True)


def pin_rank() -> list[int]:
    """Pin this process to its own share of the physical cores (every hyperthread of each), so that
    no two ranks of one host share a core: rank r of n takes the r-th n-th of the cores."""
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        key = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        cores.setdefault(key, []).append(cpu)
    rank, n = int(os.environ.get("MLX_RANK", "0")), int(os.environ.get("MLX_WORLD_SIZE", "1"))
    ordered = [cores[k] for k in sorted(cores, key=lambda k: min(cores[k]))]
    per = max(1, len(ordered) // n)
    mine = sorted(c for core in ordered[rank * per:(rank + 1) * per] for c in core)
    os.sched_setaffinity(0, mine)
    return mine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpu044b")
    ap.add_argument("--variants", default="ref,loop,rev,loop-sched,sched,fwd,new")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--bare-process", action="store_true", help="no ledger and no memory sampler")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--device", choices=("gpu", "cpu"), default=None)
    ap.add_argument("--harness", type=int, default=0, metavar="R")
    ap.add_argument("--proposed", default="nofwd", help="with --harness: the proposals run beside the reference as is")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--pin", action="store_true", help="pin each rank to its own physical cores (pin_rank)")
    args = ap.parse_args()
    if args.pin:
        print(json.dumps({"rank": os.environ.get("MLX_RANK", "0"), "pinned_to": pin_rank()}), flush=True)
    if args.device:
        import mlx.core as mx

        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    if args.harness:
        harness_runs(args)
    elif args.check:
        check(args)
    else:
        bench(args)


if __name__ == "__main__":
    main()
