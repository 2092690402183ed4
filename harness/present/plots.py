"""PNG plots for ``report.md`` (matplotlib, imported only when a report is written).

Per scenario: the loss curves of every run overlaid (1 vs N ranks), each run's loss delta from the
reference with its noise floor and limit, post-step-1 median tok/s per run and world size (with
the range over repeats), and each rank's peak memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.scenario.names import CheckName  # the lowest layer: plots imports nothing else of the harness

MB = 1024 * 1024


def _pyplot():  # noqa: ANN202
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _label(run: dict[str, Any]) -> str:
    return f"{run['name']} ({run['world_size']} rank{'s' if run['world_size'] > 1 else ''})"


def _ok_runs(scenario: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in scenario["runs"] if r["ok"] and r.get("losses")]


def _by_step(run: dict[str, Any]) -> dict[int, float]:
    start = run.get("history_start", 1)  # a resumed run's history holds the steps before its resume too
    return {start + i: v for i, v in enumerate(run["losses"])}


def loss_plot(plt: Any, scenario: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in _ok_runs(scenario):
        losses = _by_step(r)
        ax.plot(list(losses), list(losses.values()), marker="o", markersize=3, linewidth=1.2, label=_label(r),
                alpha=0.85)
    ax.set(xlabel="optimizer step", ylabel="global loss", title=f"{scenario['name']}: loss per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def delta_plot(plt: Any, scenario: dict[str, Any]) -> Any:
    """Each run's |loss - the reference's loss| per step (log scale; bitwise-equal steps sit at the
    axis' linear floor), with the run's ``loss_parity`` floor as a band and its limit as a line;
    None when the scenario has no reference or no other run."""
    runs = _ok_runs(scenario)
    ref = next((r for r in runs if r["name"] == scenario.get("reference")), None)
    others = [r for r in runs if r is not ref]
    if ref is None or not others:
        return None
    base = _by_step(ref)
    judged = {c["run"]: c for c in scenario.get("checks", []) if c["name"] == CheckName.loss_parity}
    fig, ax = plt.subplots(figsize=(7, 4))
    smallest = []
    for i, r in enumerate(others):
        losses = _by_step(r)
        steps = [k for k in losses if k in base]
        deltas = [abs(losses[k] - base[k]) for k in steps]
        ax.plot(steps, deltas, marker="o", markersize=3, linewidth=1.2, color=f"C{i}", label=_label(r))
        c = judged.get(r["name"]) or {}
        if c.get("floor"):
            ax.axhspan(0, c["floor"], color=f"C{i}", alpha=0.12, label=f"{r['name']}: noise floor")
        if c.get("limit"):
            ax.axhline(c["limit"], color=f"C{i}", linestyle="--", linewidth=1, label=f"{r['name']}: limit")
        smallest += [v for v in [*deltas, c.get("floor") or 0] if v > 0]
    ax.set_yscale("symlog", linthresh=min(smallest) / 2 if smallest else 1e-9)
    ax.set(xlabel="optimizer step", ylabel=f"|loss - {ref['name']}'s loss|",
           title=f"{scenario['name']}: loss delta from {ref['name']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def throughput_plot(plt: Any, scenario: dict[str, Any]) -> Any:
    runs = _ok_runs(scenario)
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [_label(r) for r in runs]
    values = [r["median_tok_s"] for r in runs]
    low, high = [], []
    for r, v in zip(runs, values, strict=True):
        reps = [x["median_tok_s"] for x in r.get("repeats") or [] if x["ok"]] or [v]
        low.append(v - min(reps))
        high.append(max(reps) - v)
    ax.bar(names, values, yerr=[low, high], capsize=4, color="tab:blue", alpha=0.8)
    ax.set(ylabel="post-step-1 median tok/s (global)", title=f"{scenario['name']}: throughput per run")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def memory_plot(plt: Any, scenario: dict[str, Any]) -> Any:
    runs = _ok_runs(scenario)
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, title in zip(axes, ("rss_peak_bytes", "mlx_peak_bytes"), ("peak RSS", "peak MLX memory"),
                              strict=True):
        widest = max(runs, key=lambda r: r["world_size"])  # its bars carry the rank legend
        width = 0.8 / widest["world_size"]
        for i, r in enumerate(runs):
            for rank, v in enumerate(r[key]):
                ax.bar(i + rank * width, v / MB, width=width * 0.9, color=f"C{rank}",
                       label=f"rank {rank}" if r is widest else None)
        ax.set_xticks([i + width * (r["world_size"] - 1) / 2 for i, r in enumerate(runs)],
                      [_label(r) for r in runs], rotation=20, fontsize=8)
        ax.set(ylabel="MB", title=f"{title} per rank")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{scenario['name']}: memory per rank")
    return fig


PLOTS = (("loss", loss_plot, "loss curves of every run overlaid"),
         ("delta", delta_plot, "each run's loss delta from the reference per step, with its noise floor and limit"),
         ("throughput", throughput_plot, "post-step-1 median tok/s per run"),
         ("memory", memory_plot, "peak memory per rank"))


def write_plots(out: Path, scenario: dict[str, Any]) -> list[tuple[str, Path]]:
    """The scenario's plots under ``out/plots``; (caption, path relative to ``out``) for each."""
    if not _ok_runs(scenario):
        return []
    (out / "plots").mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    written = []
    for kind, draw, caption in PLOTS:
        rel = Path("plots") / f"{scenario['name']}-{kind}.png"
        fig = draw(plt, scenario)
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(out / rel, dpi=100)
        plt.close(fig)
        written.append((caption, rel))
    return written
