"""Tables in the shape of the seed DDP parity table, and the checks table, through tabulate."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

FORMATS = {"plain": "simple", "github": "github"}
MB = 1024 * 1024

PARITY_HEADERS = [
    "Run", "World size", "Per-rank batch", "Runtime", "Post-step-1 median tok/s", "Avg loss",
    "Final loss", "Final-loss delta vs {ref}", "Peak MLX MB per rank", "Peak RSS MB per rank",
]


def _mb(values: list[int] | None) -> str:
    return " / ".join(f"{v / MB:.0f}" for v in values) if values else "-"


IMAGES_HEADER = "Post-step-1 median img/s"


def has_images(scenario: dict[str, Any]) -> bool:
    """A vision-language scenario: its table reports images/s beside tok/s."""
    return any(r.get("images_global") for r in scenario["runs"])


def parity_rows(scenario: dict[str, Any]) -> list[list[Any]]:
    rows = []
    images = has_images(scenario)
    for r in scenario["runs"]:
        if not r["ok"]:
            status = "FAILED (expected)" if r.get("expect_error") else "FAILED"
            rows.append([r["name"], r["world_size"], r["per_rank_batch"], status] + ["-"] * (6 + images))
            continue
        delta = r.get("final_loss_delta")
        img_s = r.get("median_img_s")
        rows.append([
            r["name"],
            r["world_size"],
            r["per_rank_batch"],
            f"{r['runtime_s']:.3f}s",
            f"{r['median_tok_s']:.1f}",
            *([f"{img_s:.1f}" if img_s is not None else "-"] if images else []),
            f"{r['avg_loss']:.6f}",
            f"{r['final_loss']:.6f}",
            "-" if delta is None else f"{delta:+.6f}",
            _mb(r["mlx_peak_bytes"]),
            _mb(r["rss_peak_bytes"]),
        ])
    return rows


def parity_table(scenario: dict[str, Any], fmt: str = "plain") -> str:
    ref = scenario.get("reference") or "reference"
    headers = [h.format(ref=ref) for h in PARITY_HEADERS]
    if has_images(scenario):
        headers.insert(headers.index("Post-step-1 median tok/s") + 1, IMAGES_HEADER)
    return tabulate(parity_rows(scenario), headers=headers, tablefmt=FORMATS[fmt], disable_numparse=True)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if (v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5)) else f"{v:.4g}"
    return str(v)


def checks_table(scenario: dict[str, Any], fmt: str = "plain") -> str:
    rows = [[c["name"], c["run"], _fmt(c["value"]), _fmt(c["limit"]),
             c.get("result", "pass" if c["passed"] else "FAIL"), c["detail"]] for c in scenario["checks"]]
    return tabulate(rows, headers=["Check", "Run", "Value", "Limit", "Result", "Detail"],
                    tablefmt=FORMATS[fmt], disable_numparse=True)


def failures(scenario: dict[str, Any]) -> list[str]:
    return [f"run {r['name']} (world size {r['world_size']}){' as expected' if r.get('expect_error') else ''}: "
            f"{r['failure']}" for r in scenario["runs"] if not r["ok"]]


RESUME_HEADERS = ["Run", "World size", "Resumed from", "Seed (scenario -> used)", "Steps (restored + run)",
                  "Tokens", "Loss max |delta|", "Param max |delta|", "tok/s ratio", "vs"]


def resume_rows(scenario: dict[str, Any]) -> list[list[Any]]:
    """One row per run that resumed from a checkpoint, with its resume checks' measured values."""
    checks = {(c["run"], c["name"]): c for c in scenario["checks"]}
    rows = []
    for r in scenario["runs"]:
        info = r.get("resume")
        if not r["ok"] or not info:
            continue

        def value(name: str, run: str = r["name"]) -> str:
            c = checks.get((run, name))
            return "-" if c is None else _fmt(c["value"]) + ("" if c["passed"] else " " + c.get("result", "FAIL"))

        restored = info["step"]
        rows.append([
            r["name"], r["world_size"], f"{r.get('resume_from')} @ step {restored}",
            f"{info.get('seed_scenario')} -> {r.get('seed_used')}", f"{restored} + {r['steps'] - restored}",
            r["tokens_global"], value("resume_loss_parity"), value("resume_param_parity"),
            value("resume_accounting"), r.get("compare_to") or "-",
        ])
    return rows


def resume_table(scenario: dict[str, Any], fmt: str = "plain") -> str:
    return tabulate(resume_rows(scenario), headers=RESUME_HEADERS, tablefmt=FORMATS[fmt], disable_numparse=True)


def scenario_text(scenario: dict[str, Any], fmt: str = "plain") -> str:
    """The table block the CLI prints for one scenario."""
    parts = [f"{scenario['name']}: {scenario['status'].upper()}", parity_table(scenario, fmt)]
    if resume_rows(scenario):
        parts.append(resume_table(scenario, fmt))
    if scenario["checks"]:
        parts.append(checks_table(scenario, fmt))
    parts.extend(failures(scenario))
    return "\n\n".join(parts)
