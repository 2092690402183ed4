"""Parts of the scenario ``mlx-ddp-harness new`` writes that depend on what it is given: the
known behaviour a trainer shows on the rows, the LoRA keys, the throughput runs, and whether a
user's script reports through ``harness.api`` at all."""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from harness.scenario import Scenario, ScenarioError
from harness.scenario.trainer_info import TrainerInfo

BEHAVIOUR = "mean_of_means"
PER_RANK_BATCH = 4  # rows each rank trains per step in a throughput scenario

_API = re.compile(r"\bharness\.api\b|\bfrom\s+harness\s+import\s+(?:\([^)]*|[^\n]*)\bapi\b")


def uses_harness_api(script: Path) -> bool:
    """Whether the script's text names ``harness.api`` (``import harness.api``, ``from
    harness.api import ...``, or ``api`` in a ``from harness import ...``)."""
    try:
        text = script.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ScenarioError(f"--script: {script}: cannot be read ({e.strerror or e})") from e
    return _API.search(text) is not None


def supervised_tokens(s: Scenario) -> list[int]:
    """Each training row's supervised tokens, the rows read, tokenized and truncated as the
    scenario's trainer gets them (the harness's own row source and encoder; an image row's
    caption, whose tokens the image block in front of it does not change). A row with none is
    refused, as mlx-lm and mlx-vlm refuse it."""
    from harness.controller.inputs import prepare
    from harness.data.rows import load_rows

    s = prepare(s)
    try:
        if s.model.vision:
            from harness.data.images import image_row_source, image_text_row
            from harness.data.sources import Encoder
            from harness.data.tokenizers import load_tokenizer

            tok = load_tokenizer(s.data)
            text = Encoder(tok, s.data)
            rows = load_rows(s, lambda where, row: text(where, image_text_row(where, row)), image_row_source, tok)
        else:
            rows = load_rows(s)
        empty = next((where for where, ex in rows.train if ex.tokens == 0), None)
        if empty is not None:
            raise ValueError(f"{empty}: no supervised tokens")
    except ValueError as e:
        raise ScenarioError(f"{e}, as {s.trainer.kind} gets the row ([data] max_seq_len = {s.data.max_seq_len} "
                            "keeps a row's first tokens)") from e
    return [ex.tokens for _, ex in rows.train]


@dataclass(frozen=True)
class ExpectedBlock:
    """A known behaviour block for the written file, and the line ``new`` prints about it."""

    text: str
    line: str


def mean_of_means(s: Scenario, info: TrainerInfo) -> ExpectedBlock | None:
    """The documented expected-failure block (``TrainerInfo.known_behaviour``), where the trainer
    averages the ranks' mean losses and the rows' supervised tokens differ (each rank's mean is
    then over another number of tokens, so N ranks optimize another objective than one process);
    ``None`` where they cannot."""
    judged = [r.name for r in s.runs if r.name != s.checks.reference]
    if info.known_behaviour is None or s.kind != "parity" or not judged or max(r.world_size for r in s.runs) == 1:
        return None
    counts = supervised_tokens(s)
    if len(set(counts)) < 2:
        return None
    reason, checks = info.known_behaviour
    lo, hi = min(counts), max(counts)
    shown = ", ".join(f"{k} = {v!r}" for k, v in checks.items())
    why = (f"A known behaviour (docs/trainers.md): {reason}. These rows hold {lo} to {hi} supervised tokens each, so "
           "each rank's mean is over another number of tokens and runs of other rank counts optimize other "
           "objectives: the parity checks below are expected to fail and report their measured values (\"xfail\"). "
           f"The values are those scenarios/{info.kind}_mean_of_means.toml measured. Should they all pass (\"XPASS\", "
           "a failure), the behaviour did not show on these rows: remove this block.")
    text = "\n".join([*(f"# {line}" for line in textwrap.wrap(why, 96)), f"[checks.expected_failures.{BEHAVIOUR}]",
                      f'reason = "{reason}"', f"checks = {{ {shown} }}", ""])
    line = (f"added the expected failures [checks.expected_failures.{BEHAVIOUR}]: {reason}, and these rows hold "
            f"{lo} to {hi} supervised tokens each, so {', '.join(judged)} will not match {s.checks.reference} "
            "(docs/trainers.md)")
    return ExpectedBlock(text, line)


def lora_lines(info: TrainerInfo) -> list[str]:
    """The ``[trainer]`` keys of a LoRA fine-tune (scenarios/mlx_lm_lora.toml's values)."""
    note = info.lora_layers_note or "the last N transformer layers get adapters (-1: every layer)"
    layers = f"lora_layers = -1    # {note}"
    if info.script:
        return ['fine_tune = "lora"  # run.model() returns the model frozen, with LoRA adapters: train',
                "#                      model.trainable_parameters() and hand them to run.step and run.finish",
                "lora_rank = 8", "lora_scale = 20.0", layers]
    return ['fine_tune = "lora"  # only the adapters train (and parity compares them)',
            "lora_rank = 8", "lora_scale = 20.0", layers]


def throughput_runs(runs: list[tuple[str, int]]) -> list[str]:
    """The ``[[runs]]`` of a throughput scenario: every rank trains ``PER_RANK_BATCH`` rows a
    step, so each run's global batch grows with its ranks (the first run's is ``[train]``'s)."""
    lines = []
    for i, (run, n) in enumerate(runs):
        lines += ["[[runs]]", f'name = "{run}"', f"world_size = {n}"]
        if i:
            lines.append(f"train = {{ global_batch = {PER_RANK_BATCH * n} }}   # {n} ranks x {PER_RANK_BATCH} rows")
        lines.append("")
    return lines
