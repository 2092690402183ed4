"""Tables through tabulate: runs in the seed's parity and guide-shape throughput shapes, resume, checks."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from harness.present.conditions import MARK, condition_notes, disturbed
from harness.present.shapes import width_cell, width_warnings
from harness.scenario.checks import CheckName

FORMATS = {"plain": "simple", "github": "github"}


def table(rows: list[list[Any]], headers: list[str], fmt: str = "plain") -> str:
    """A table in ``fmt``; in GitHub markdown every ``|`` a cell holds is escaped (``\\|``), so
    a value such as ``||g - g_ref||`` cannot split its cell."""
    if fmt == "github":
        rows = [[str(c).replace("|", "\\|") if c is not None else c for c in row] for row in rows]
        headers = [h.replace("|", "\\|") for h in headers]
    return tabulate(rows, headers=headers, tablefmt=FORMATS[fmt], disable_numparse=True)


MB = 1024 * 1024
WARM_NOTE = ("its ranks forked from a warm-start server (MLX_DDP_HARNESS_WARM_RANKS), so its start-up "
             "figures hold none of their imports")

PARITY_HEADERS = [
    "Model / seq", "Run", "World size", "Per-rank batch", "Runtime", "Post-step-1 median tok/s", "Avg loss",
    "Final loss", "Final-loss delta vs {ref}", "Peak MLX MB per rank", "Peak RSS MB per rank",
]
THROUGHPUT_HEADERS = [
    "Model / seq", "Run", "World size", "Per-rank batch", "Effective global batch", "Runtime", "Tokens",
    "Padded width", "Post-step-1 median tok/s", "Speed vs {ref}", "Avg loss", "Final loss", "Peak MLX MB per rank",
    "Peak RSS MB per rank",
]
IMAGES_HEADER = "Post-step-1 median img/s"
TOK_S_HEADER = "Post-step-1 median tok/s"


def _mb(values: list[int] | None) -> str:
    return " / ".join(f"{v / MB:.0f}" for v in values) if values else "-"


def has_images(scenario: dict[str, Any]) -> bool:
    """A vision-language scenario: its table reports images/s beside tok/s."""
    return any(r.get("images_global") for r in scenario["runs"])


def trainer_label(run: dict[str, Any]) -> str:
    """The trainer kind that ran ``run`` (``-`` in a result that does not record it)."""
    return run.get("trainer") or "-"


def fine_tune_label(run: dict[str, Any]) -> str:
    """``full``, ``lora r=8`` (with the layers adapted when not all), ``set by the script`` for a
    script or command, which fine-tunes as its own code does, or ``-`` where not recorded."""
    if "fine_tune" not in run:
        return "-"
    if run["fine_tune"] is None:
        return f"set by the {trainer_label(run)}"
    lora = run.get("lora")
    if run["fine_tune"] != "lora" or not lora:
        return str(run["fine_tune"])
    return f"lora r={lora['rank']}" + ("" if lora.get("layers", -1) == -1 else f", {lora['layers']} layers")


def setups(scenario: dict[str, Any]) -> list[tuple[str, str]]:
    """Each run's (trainer, fine-tune) labels, in run order."""
    return [(trainer_label(r), fine_tune_label(r)) for r in scenario["runs"]]


def setup_columns(scenario: dict[str, Any]) -> bool:
    """Whether the run table needs Trainer and Fine-tune columns: its runs differ in either (one
    setup shared by every run is named once, in the table's title)."""
    return len(set(setups(scenario))) > 1


def repeat_count(scenario: dict[str, Any]) -> int:
    """How many repeats the run table's speed figures are the median of (1: a single run)."""
    if not any(r.get("over_repeats") for r in scenario["runs"]):
        return 1
    return scenario.get("repeats") or 1


def _stats(run: dict[str, Any], key: str) -> dict[str, Any] | None:
    return (run.get("over_repeats") or {}).get(key)


def losses_vary(scenario: dict[str, Any]) -> bool:
    """Whether a run's losses differed from repeat to repeat (then the table shows their median)."""
    keys = ("avg_loss", "final_loss", "final_loss_delta")
    return any((st := _stats(r, k)) and st["min"] != st["max"] for r in scenario["runs"] for k in keys)


def _cell(value: float | None, st: dict[str, Any] | None, form: str, repeats: int, suffix: str = "",
          note: str = "") -> str:
    """``value`` formatted with ``form``, or over repeats (``st``) their median, with the min-max
    range where it is not one value and the count where some repeats did not complete; ``note``
    goes into the same parentheses."""
    if st is None or repeats < 2:
        notes = [note] if note else []
        shown = "-" if value is None else f"{value:{form}}{suffix}"
    else:
        med, lo, hi = (f"{st[k]:{form}}" for k in ("median", "min", "max"))
        notes = [f"{lo}-{hi}{suffix}"] if lo != hi else []
        notes += [f"{st['n']} of {repeats} repeats"] if st["n"] < repeats else []
        notes += [note] if note else []
        shown = f"{med}{suffix}"
    return shown + (f" ({'; '.join(notes)})" if notes else "")


def _figure(run: dict[str, Any], key: str, form: str, repeats: int, suffix: str = "") -> str:
    return _cell(run.get(key), _stats(run, key), form, repeats, suffix)


def setup_difference(run: dict[str, Any], ref: dict[str, Any]) -> str:
    """What sets ``run`` apart from ``ref`` beyond its world size and batch: ``mlx_lm vs
    reference``, ``lora r=8 vs full`` (empty when they share trainer and fine-tune). A fine-tune
    that a script or command sets itself is not known, so only its trainer is compared."""
    pairs = [(trainer_label(run), trainer_label(ref))]
    if run.get("fine_tune") and ref.get("fine_tune"):
        pairs.append((fine_tune_label(run), fine_tune_label(ref)))
    return "; ".join(f"{a} vs {b}" for a, b in pairs if a != b and "-" not in (a, b))


def _speed(run: dict[str, Any], ref: dict[str, Any] | None, repeats: int) -> str:
    """Speed vs the reference run (over repeats: the median of each repeat's ratio), saying where
    the two runs' trainer or fine-tune differ."""
    if not ref or not ref.get("ok") or not ref.get("median_tok_s"):
        return "-"
    return _cell(run["median_tok_s"] / ref["median_tok_s"], _stats(run, "speed_vs_reference"), ".2f", repeats, "x",
                 setup_difference(run, ref))


def run_headers(scenario: dict[str, Any]) -> list[str]:
    """The run table's headers: the parity or throughput shape, img/s for a vision-language
    scenario, Trainer and Fine-tune where the runs differ in them, and over repeats which figures
    are the median of how many repeats."""
    ref = scenario.get("reference") or "reference"
    shape = THROUGHPUT_HEADERS if scenario.get("kind") == "throughput" else PARITY_HEADERS
    headers = [h.format(ref=ref) for h in shape]
    if has_images(scenario):
        headers.insert(headers.index(TOK_S_HEADER) + 1, IMAGES_HEADER)
    if setup_columns(scenario):
        headers[2:2] = ["Trainer", "Fine-tune"]
    repeats = repeat_count(scenario)
    if repeats > 1:
        over = f" (median of {repeats} repeats, min-max)"
        medians = {"Runtime", TOK_S_HEADER, IMAGES_HEADER, f"Speed vs {ref}"}
        if losses_vary(scenario):
            medians |= {"Avg loss", "Final loss", f"Final-loss delta vs {ref}"}
        headers = [h + over if h in medians else h for h in headers]
    return headers


def run_rows(scenario: dict[str, Any]) -> list[list[Any]]:
    """One row per run, in the seed's parity-table shape, or its guide-shape throughput shape for
    a ``throughput`` scenario (effective global batch, tokens and speed vs the reference run,
    saying where the run's trainer or fine-tune differs from the reference's). Over repeats the
    speed figures are their median and range; the losses too where they differ between repeats."""
    throughput = scenario.get("kind") == "throughput"
    images = has_images(scenario)
    ref = next((r for r in scenario["runs"] if r["name"] == scenario.get("reference")), None)
    columns = setup_columns(scenario)
    width = len(THROUGHPUT_HEADERS if throughput else PARITY_HEADERS) + images + 2 * columns
    repeats = repeat_count(scenario)
    over = repeats if losses_vary(scenario) else 1
    rows = []
    for r in scenario["runs"]:
        name = f"{r['name']} (floor)" if r.get("floor") else r["name"]
        head = [scenario.get("model", "-"), name, *([trainer_label(r), fine_tune_label(r)] if columns else []),
                r["world_size"], r["per_rank_batch"]]
        if throughput:
            head.append(r["global_batch"])
        if not r["ok"]:
            status = "FAILED (expected)" if r.get("expect_error") else "FAILED"
            rows.append(head + [status] + ["-"] * (width - len(head) - 1))
            continue
        mark = f" {MARK}" if disturbed(r) else ""
        speed = [_figure(r, "median_tok_s", ".1f", repeats) + mark,
                 *([_figure(r, "median_img_s", ".1f", repeats)] if images else [])]
        losses = [_figure(r, "avg_loss", ".6f", over), _figure(r, "final_loss", ".6f", over)]
        memory = [_mb(r["mlx_peak_bytes"]), _mb(r["rss_peak_bytes"])]
        runtime = _figure(r, "runtime_s", ".3f", repeats, "s")
        if throughput:
            rows.append(head + [runtime, r["tokens_global"], width_cell(r), *speed, _speed(r, ref, repeats), *losses,
                                *memory])
        else:
            rows.append(head + [runtime, *speed, *losses, _figure(r, "final_loss_delta", "+.6f", over), *memory])
    return rows


def runs_table(scenario: dict[str, Any], fmt: str = "plain") -> str:
    return table(run_rows(scenario), run_headers(scenario), fmt)


def runs_title(scenario: dict[str, Any]) -> str:
    """The run table's title: its shape, and the trainer and fine-tune every run shares."""
    if scenario.get("kind") == "throughput":
        title = f"Throughput vs {scenario.get('reference')} (runs at different global batches: not a parity test)"
    else:
        title = "DDP parity at equal global batch"
    shared = set(setups(scenario))
    if len(shared) == 1 and (setup := shared.pop()) != ("-", "-"):
        title += f"; trainer: {setup[0]}; fine-tune: {setup[1]}"
    devices = {(r.get("device"), r.get("device_reason")) for r in scenario["runs"]}
    if len(devices) == 1 and (device := devices.pop())[0]:  # else ``device_notes`` says it per run
        title += f"; device: {device[0]}" + (f" ({device[1]})" if device[1] else "")
    return title


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if (v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5)) else f"{v:.4g}"
    return str(v)


def checks_table(scenario: dict[str, Any], fmt: str = "plain") -> str:
    """Every check: its value, the measured noise floor and value / floor where the limit was
    derived from one, the limit (for a parity check also its power: the smallest deviation it
    could detect), the result, and the precision a parity check's runs computed at."""
    rows = [[c["name"], c["run"], _fmt(c["value"]), _fmt(c.get("floor")), _fmt(c.get("ratio")), _fmt(c["limit"]),
             c.get("result", "pass" if c["passed"] else "FAIL"), c.get("precision") or "-", c["detail"]]
            for c in scenario["checks"]]
    return table(rows, ["Check", "Run", "Value", "Floor", "Ratio", "Limit", "Result", "Precision", "Detail"], fmt)


def floor_notes(scenario: dict[str, Any]) -> list[str]:
    """What each noise-floor run computes (they are measurements, not judged)."""
    return [f"{r['name']} (floor): {r['floor']}" for r in scenario["runs"] if r.get("floor")]


MUTATION_HEADERS = ["Mutation", "What it does", "Caught by", "Value", "Limit", "Margin",
                    "Also failing (or what it showed)"]


def mutation_rows(scenario: dict[str, Any]) -> list[list[Any]]:
    """One row per run with an injected bug (``scenario["mutations"]``,
    ``harness.run.mutation_summary``): the check that caught it (the clearest one with a
    measured margin of at least ``mutation_margin``, else an exact criterion that failed: a count
    or digest that must match) and the others that failed; for a straggler or a rank killed, how
    the run came out."""
    rows = []
    for m in scenario.get("mutations") or []:
        status = "" if m["outcome"] == "caught" else f" {m['outcome']}"
        margin = _fmt(m["margin"]) if m.get("margin") is not None else ("exact" if m.get("exact") else "-")
        others = ", ".join(a["check"] + (f" ({_fmt(a['margin'])})" if a.get("margin") is not None else " (exact)")
                           for a in m["also"])
        if m["expects"] != "caught":  # it must pass, or fail naming its rank: the outcome, and what it showed
            status, others = m["outcome"], m["detail"]
        else:
            status = (m["by"] or "-") + status
        rows.append([m["mutation"], m["what"], status, _fmt(m["value"]), _fmt(m["limit"]), margin, others])
    return rows


def mutation_table(scenario: dict[str, Any], fmt: str = "plain") -> str:
    return table(mutation_rows(scenario), MUTATION_HEADERS, fmt)


def failures(scenario: dict[str, Any]) -> list[str]:
    return [f"run {r['name']} (world size {r['world_size']}){' as expected' if r.get('expect_error') else ''}: "
            f"{r['failure']}" for r in scenario["runs"] if not r["ok"]]


RESUME_HEADERS = ["Run", "World size", "Resumed from", "Seed (scenario -> used)", "Steps (restored + run)",
                  "Tokens", "Loss max |delta|", "Param delta (rel. L2)", "tok/s ratio", "vs"]


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
            r["tokens_global"], value(CheckName.resume_loss_parity), value(CheckName.resume_param_parity),
            value(CheckName.resume_accounting), r.get("compare_to") or "-",
        ])
    return rows


def resume_table(scenario: dict[str, Any], fmt: str = "plain") -> str:
    return table(resume_rows(scenario), RESUME_HEADERS, fmt)


REPEAT_HEADERS = ["Run", "Repeats", "Post-step-1 median tok/s per repeat", "Spread (stdev / median)",
                  "Loss max |delta| between repeats", "Peak MLX MB per rank (min-max)",
                  "Peak RSS MB per rank (min-max)"]


def _mb_range(samples: list[list[int]]) -> str:
    return " / ".join(f"{min(v) / MB:.0f}-{max(v) / MB:.0f}" for v in zip(*samples, strict=True))


def repeat_rows(scenario: dict[str, Any]) -> list[list[Any]]:
    """With ``--repeat``: how each run's figures varied from repeat to repeat."""
    from harness.judge.baselines import relative_spread

    rows = []
    for r in scenario["runs"]:
        reps = [x for x in r.get("repeats") or [] if x["ok"]]
        if len(reps) < 2:
            continue
        tok_s = [x["median_tok_s"] for x in reps]
        loss = max(abs(a - b) for x in reps[1:] for a, b in zip(x["losses"], reps[0]["losses"], strict=False))
        rows.append([r["name"], len(reps), " / ".join(f"{v:.1f}" for v in tok_s), f"{relative_spread(tok_s):.1%}",
                     _fmt(loss), _mb_range([x["mlx_peak_bytes"] for x in reps]),
                     _mb_range([x["rss_peak_bytes"] for x in reps])])
    return rows


def repeat_table(scenario: dict[str, Any], fmt: str = "plain") -> str:
    return table(repeat_rows(scenario), REPEAT_HEADERS, fmt)


def host_ranks(hosts: list[str]) -> str:
    """``a: ranks 0,1; b: ranks 2,3`` from a run's rank -> host list."""
    names = list(dict.fromkeys(hosts))
    return "; ".join(f"{h}: rank{'s' if hosts.count(h) > 1 else ''} "
                     f"{','.join(str(r) for r, x in enumerate(hosts) if x == h)}" for h in names)


def device_notes(scenario: dict[str, Any]) -> list[str]:
    """Where runs that differ in device or in why computed, and why (where ``auto`` chose or the
    device check moved them): one line per device and reason. Runs that share both have them in
    the title (``runs_title``)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for r in scenario["runs"]:
        if r.get("device"):
            groups.setdefault((r["device"], r.get("device_reason") or "as asked"), []).append(r["name"])
    if len(groups) < 2 and all(r.get("device") for r in scenario["runs"]):
        return []
    return [f"run {', '.join(names)} on {device}: {why}" for (device, why), names in groups.items()]


def scenario_text(scenario: dict[str, Any], fmt: str = "plain") -> str:
    """The table block the CLI prints for one scenario."""
    unseen = scenario.get("inconclusive") or []
    status = scenario["status"].upper() + (f" (inconclusive, without power to see a known behaviour: "
                                           f"{', '.join(unseen)})" if unseen else "")
    gap = "\n\n" if fmt == "github" else "\n"  # a GitHub table must not continue the title's paragraph
    parts = [f"{scenario['name']}: {status}", runs_title(scenario) + gap + runs_table(scenario, fmt)]
    if floor_notes(scenario):
        parts.append("\n".join(floor_notes(scenario)))
    conditions = condition_notes(scenario)
    if conditions:
        parts.append("\n".join(conditions))
    backends = [f"run {r['name']} on {r['backend']}: {r['backend_reason']}" for r in scenario["runs"]
                if r.get("backend_reason")]
    backends += [f"run {r['name']} on {r['backend']}: {r['ring_yield']}" for r in scenario["runs"]
                 if r.get("ring_yield")]
    backends += [f"run {r['name']}: {WARM_NOTE}" for r in scenario["runs"] if r.get("warm_start")]
    if backends:
        parts.append("\n".join(backends))
    if device_notes(scenario):
        parts.append("\n".join(device_notes(scenario)))
    if scenario.get("kind") == "throughput" and width_warnings(scenario):
        parts.append("\n".join(width_warnings(scenario)))
    placed = [f"run {r['name']} across hosts: {host_ranks(r['hosts'])}" for r in scenario["runs"] if r.get("hosts")]
    placed += [f"run {r['name']}: {note}" for r in scenario["runs"] for note in r.get("notes") or []]
    if placed:
        parts.append("\n".join(placed))
    if mutation_rows(scenario):
        parts.append(mutation_table(scenario, fmt))
    if repeat_rows(scenario):
        parts.append(repeat_table(scenario, fmt))
    if resume_rows(scenario):
        parts.append(resume_table(scenario, fmt))
    if scenario["checks"]:
        parts.append(checks_table(scenario, fmt))
    parts.extend(failures(scenario))
    return "\n\n".join(parts)
