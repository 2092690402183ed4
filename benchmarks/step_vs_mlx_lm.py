"""The reference trainer's speed beside mlx-lm's own step, on the same model, dtype, per-rank batch
and world size, in one invocation.

For each world size and compile mode it runs the harness's reference trainer (a throughput
scenario: generated rows at least ``--seq`` tokens long, truncated to it, every token a target)
and the anchor (``harness.rank.anchor``: mlx-lm's ``default_loss``, ``nn.average_gradients`` and
the update in a plain loop, compiled together when compiling, on random tokens of the same
shape), both launched by the harness, and prints post-step-1 median tok/s, the ratio, the scaling
over one rank, and the model FLOPs utilization where the device's peak is known (``PEAKS``:
the vendors' dense bf16/fp16 tensor-core figures; none for CPUs).

Each run alternates the two trainers ``--repeats`` times and keeps each one's best post-step-1
median, so that a slow phase of a shared machine does not decide the ratio. For every world size
above the first, a second table puts the gradient all-reduce alone (``nn.average_gradients`` on
a gradient of the model's shapes, ``harness.rank.anchor.allreduce``) beside what the harness's
eager step takes over the first world size's at the same per-rank batch.

usage: python benchmarks/step_vs_mlx_lm.py [--model tiny|cpu3m|gpu044b] [--world-sizes 1,2]
                                           [--steps N] [--repeats R] [--backend ring|nccl]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from tabulate import tabulate

from harness.controller.session import execute
from harness.controller.suite import train_job
from harness.scenario import load_scenario

# model config overrides (of the tiny qwen3), dtype, sequence length, per-rank batch
MODELS: dict[str, tuple[dict[str, Any], str, int, int]] = {
    "tiny": ({}, "float32", 160, 8),  # steps of a few ms: time 40 of them (--steps), the median is steadier
    "cpu3m": ({"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64}, "float32", 256, 8),
    "gpu044b": ({"hidden_size": 1024, "num_hidden_layers": 28, "intermediate_size": 3072, "num_attention_heads": 16,
                 "num_key_value_heads": 8, "head_dim": 128}, "bfloat16", 1024, 8),
}
# Dense bf16/fp16 tensor-core peak FLOP/s by device name (NVIDIA's data sheets, SXM parts).
PEAKS = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12}


def scenario_text(model: str, world_sizes: list[int], steps: int) -> str:
    config, dtype, seq, per_rank = MODELS[model]
    cfg = ", ".join(f"{k} = {v}" for k, v in config.items())
    modes = {"eager": "off", "compiled": "best_effort"}
    runs = "".join(f'\n[[runs]]\nname = "ws{n}_{c}"\nworld_size = {n}\n'
                   f'train = {{ global_batch = {per_rank * n}, compile = "{modes[c]}" }}\n'
                   for n in world_sizes for c in modes)
    return (f'[scenario]\nname = "step_vs_mlx_lm"\ndescription = "reference trainer vs mlx-lm step"\nseed = 5\n'
            f'kind = "throughput"\n\n[model]\narch = "qwen3"\ndtype = "{dtype}"\nconfig = {{ {cfg} }}\n\n'
            f'[data]\nsource = "generated"\nresponse_only = false\nrows = 64\nmin_chars = {2 * seq}\n'
            f'max_chars = {2 * seq}\nmax_seq_len = {seq}\n\n[train]\nsteps = {steps}\nglobal_batch = {per_rank}\n'
            f'learning_rate = 1e-4\n{runs}\n[checks]\nreference = "ws{world_sizes[0]}_eager"\n')


def post_step1_median(result: dict[str, Any]) -> float:
    values = result["tok_s_global"]
    return statistics.median(values[1:] if len(values) > 1 else values)


def flops_per_token(params: int, config: dict[str, Any], seq: int) -> float:
    """6 N per trained token, plus the attention scores and values (12 x layers x seq x width)."""
    width = config["num_attention_heads"] * config["head_dim"]
    return 6 * params + 12 * config["num_hidden_layers"] * seq * width


def device_peak() -> tuple[str, float | None]:
    import mlx.core as mx

    try:
        name = str(mx.device_info().get("device_name", mx.default_device()))
    except Exception:
        name = str(mx.default_device())
    return name, PEAKS.get(name)


def launch(spec: Any, job: dict[str, Any], backend: str | None) -> dict[str, Any]:
    """Rank 0's result of ``job`` on ``spec``'s world size; a failed run ends the benchmark."""
    out = execute(f"{spec.name}_{job['kind']}", job, spec.world_size, backend=backend or spec.backend)
    if not out.ok:
        raise SystemExit(f"{spec.name} ({job['kind']}): {out.failure}")
    return out.result(0)


def measure(spec: Any, job: dict[str, Any], backend: str | None) -> tuple[float, dict[str, Any]]:
    result = launch(spec, job, backend)
    return post_step1_median(result), result


def allreduce_rows(s: Any, steps: dict[tuple[int, str], float], backend: str | None) -> list[list[Any]]:
    """Per world size above one: the gradient all-reduce alone (``grad_allreduce``) beside what
    the harness's eager step gains over one rank at the same per-rank batch."""
    rows, first = [], min(n for n, _ in steps)
    for spec in s.runs:
        if spec.world_size == first or not spec.name.endswith("_eager"):
            continue
        ar = launch(spec, {"kind": "grad_allreduce", "scenario": s.for_run(spec).to_dict(), "repeats": 10}, backend)
        step_n, step_1 = steps[(spec.world_size, "eager")], steps[(first, "eager")]
        rows.append([spec.world_size, f"{ar['bytes'] / 2**20:.1f}", f"{ar['allreduce_s'] * 1e3:.2f}",
                     f"{step_1 * 1e3:.2f}", f"{step_n * 1e3:.2f}", f"{(step_n - step_1) * 1e3:.2f}",
                     f"{ar['allreduce_s'] / step_n:.1%}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: 40 for tiny, else 12)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="alternate the two trainers this many times per run and keep each one's best median")
    ap.add_argument("--backend", default=None)
    args = ap.parse_args()
    sizes = [int(n) for n in args.world_sizes.split(",")]
    args.steps = args.steps or (40 if args.model == "tiny" else 12)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "step_vs_mlx_lm.toml"
        path.write_text(scenario_text(args.model, sizes, args.steps))
        s = load_scenario(path)
    _, dtype, seq, per_rank = MODELS[args.model]
    name, peak = device_peak()
    mfu_ok = peak is not None and dtype in ("bfloat16", "float16")
    rows, base, step_s = [], {}, {}
    for spec in s.runs:
        jobs = (train_job(s, spec), {"kind": "mlx_lm_step", "scenario": s.for_run(spec).to_dict()})
        best: list[tuple[float, dict[str, Any]]] = [(0.0, {}), (0.0, {})]
        for _ in range(args.repeats):  # alternating, so that a slow phase of the machine hits both
            for i, job in enumerate(jobs):
                best[i] = max(best[i], measure(spec, job, args.backend), key=lambda f: f[0])
        (ours, result), (theirs, _) = best
        params = result["param_count"]
        mode = spec.name.split("_")[1]
        base.setdefault(mode, (ours, theirs))
        step_s[(spec.world_size, mode)] = result["tokens_global_per_step"][0] / ours
        per_token = flops_per_token(params, result["model_config"], seq)  # the config the model was built from
        mfu = [f"{v * per_token / (peak * spec.world_size):.1%}" if mfu_ok else "-" for v in (ours, theirs)]
        rows.append([spec.world_size, mode, f"{ours:.0f}", f"{theirs:.0f}", f"{ours / theirs:.2f}x",
                     f"{ours / base[mode][0]:.2f}x / {theirs / base[mode][1]:.2f}x", *mfu])
    print(f"{args.model}: qwen3 {params / 1e6:.2f}M, {dtype}, {per_rank} x {seq} tokens per rank, {args.steps} steps, "
          f"best of {args.repeats}, on {name} (peak: {'%.0f TFLOP/s' % (peak / 1e12) if peak else 'unknown'})")
    print(tabulate(rows, headers=["World size", "Mode", "Harness tok/s", "mlx-lm step tok/s", "Harness / mlx-lm",
                                  f"Scaling vs {sizes[0]} (harness / mlx-lm)", "MFU harness", "MFU mlx-lm"]))
    reduce_rows = allreduce_rows(s, step_s, args.backend)
    if reduce_rows:
        print()
        print(tabulate(reduce_rows, headers=["World size", "Gradient MiB", "all-reduce ms (alone)",
                                             f"Harness step ms at {sizes[0]}", "Harness step ms", "Extra ms",
                                             "All-reduce share of step"]))


if __name__ == "__main__":
    main()
