"""A scenario's local input files, read before any rank starts, as the ranks will read them.

A rank that meets a bad row or a bad tokenizer file stops every rank with its message, but only
after the launch; here the same readers run in the controller first, so such input is refused
with one line naming the file (and the line) and exit 2, before anything runs or is written.
Text rows are encoded with the byte tokenizer (the row forms and chat structure every trainer's
encoder demands); a ``tokenizer.json`` is loaded; a VLM row's image must exist and be an image.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from harness.scenario import DataSpec, RunSpec, Scenario, ScenarioError

Runs = list[tuple[RunSpec, DataSpec]]  # each declared run with its effective [data], in file order


def _check_count(s: Scenario, runs: Runs, key: str, path: Path, rows: int) -> None:
    """A rows file must hold a row for every rank of every run that reads it."""
    for i, (r, d) in enumerate(runs):
        reads = d.path if key == "path" and d.source == "jsonl" else d.eval_path if key == "eval_path" else None
        if reads is not None and Path(reads) == path and r.world_size > rows:
            what = "rows" if key == "path" else "eval rows"
            held = f"{rows} {what if rows != 1 else what[:-1]}"
            raise ScenarioError(f"{s.path}: [[runs]][{i}].world_size: {r.world_size} ranks but {path} holds "
                                f"{held}: every rank needs {what} of its own")


def _files(runs: Runs) -> Iterator[tuple[DataSpec, str, Path, int | None]]:
    """(data spec, key, file, rows read) for every local rows file of the scenario's runs, once."""
    seen = set()
    for _, d in runs:
        for key, path, limit in (("path", d.path if d.source == "jsonl" else None, d.rows),
                                 ("eval_path", d.eval_path, None)):
            if path and (str(path), limit, d.format) not in seen:
                seen.add((str(path), limit, d.format))
                yield d, key, Path(path), limit


def check_text_rows(s: Scenario, runs: Runs) -> list[str]:
    """Refuse bad JSONL rows; returns a line for each file whose rows ``max_seq_len`` cuts
    (``cut_rows``)."""
    from harness.data.sources import Encoder, jsonl_rows
    from harness.data.tokenizers import ByteTokenizer

    notes = []
    for d, key, path, limit in _files(runs):
        if path.is_dir():
            raise ScenarioError(f"{s.path}: [data].{key}: {path} is a directory, not a JSONL file")
        encode, rows = Encoder(ByteTokenizer(), d), 0
        try:
            for where, row in jsonl_rows(path, limit):
                encode(where, row)
                rows += 1
        except ValueError as e:
            raise ScenarioError(str(e)) from e
        if not rows:
            raise ScenarioError(f"{s.path}: [data].{key}: {path} has no rows")
        _check_count(s, runs, key, path, rows)
        try:
            notes += cut_rows(s, d, key, path, limit, rows, encode.cut)
        except ValueError as e:  # a row the scenario's tokenizer cannot take, as its ranks would find
            raise ScenarioError(str(e)) from e
    return notes


def cut_rows(s: Scenario, d: DataSpec, key: str, path: Path, limit: int | None, rows: int,
             cut: list[tuple[str, int]]) -> list[str]:
    """The line saying how many rows of ``path`` are longer than ``max_seq_len`` and cut to it,
    naming the first of them; counted in the scenario's tokens where its tokenizer is a local file
    (``cut``: the byte tokenizer's count, exact for ``byte``, an upper bound for a BPE trained
    from the rows, whose rows are not counted here)."""
    from harness.data.sources import Encoder, jsonl_rows
    from harness.data.tokenizers import FileTokenizer

    if d.tokenizer.startswith("bpe:") or not cut:
        return []
    if d.tokenizer != "byte":
        encode = Encoder(FileTokenizer(d.tokenizer), d)
        for where, row in jsonl_rows(path, limit):
            encode(where, row)
        cut = encode.cut
    if not cut:
        return []
    lines = ", ".join(where.rsplit(":", 1)[-1] for where, _ in cut[:5]) + (", ..." if len(cut) > 5 else "")
    return [f"{s.name}: [data].{key}: {len(cut)} of {rows} rows of {path} are longer than max_seq_len = "
            f"{d.max_seq_len} tokens and are cut to it (lines {lines}; the longest {max(n for _, n in cut)} "
            f"tokens): raise [data] max_seq_len to train them whole"]


def check_image_rows(s: Scenario, runs: Runs) -> None:
    """Every image a VLM scenario's JSONL rows name must exist and be an image Pillow can read
    (the rows are read as the ranks read them)."""
    from PIL import Image, UnidentifiedImageError

    from harness.data.images import image_text_row, local_image_rows
    from harness.data.sources import Encoder
    from harness.data.tokenizers import ByteTokenizer

    for d, key, path, limit in _files(runs):
        encode, rows = Encoder(ByteTokenizer(), d), 0
        try:
            for where, row in local_image_rows(path, limit):
                rows += 1
                encode(where, image_text_row(where, row))
                image = row.get("image")
                if not isinstance(image, str):
                    raise ScenarioError(f"{where}: an image row needs an \"image\" path string")
                if not Path(image).is_file():
                    raise ScenarioError(f"{where}: image not found: {image}")
                try:
                    with Image.open(image) as im:
                        im.verify()
                except (UnidentifiedImageError, OSError, SyntaxError) as e:
                    raise ScenarioError(f"{where}: {image} is not an image Pillow can read ({e})") from e
        except ScenarioError:
            raise
        except ValueError as e:  # a line that is not JSON, a file that is not UTF-8
            raise ScenarioError(str(e)) from e
        _check_count(s, runs, key, path, rows)


def check_tokenizers(s: Scenario, runs: Runs) -> list[str]:
    """Refuse a tokenizer file that does not load; a line for each special token a file lacks."""
    from harness.data.tokenizers import FileTokenizer

    notes: list[str] = []
    for i, (r, d) in enumerate(runs):
        tok = d.tokenizer
        if tok == "byte" or tok.startswith("bpe:"):
            continue
        try:
            loaded = FileTokenizer(tok)
        except ValueError as e:
            where = f"[[runs]][{i}].data.tokenizer" if "tokenizer" in r.data else "[data].tokenizer"
            raise ScenarioError(f"{s.path}: {where}: {e}") from e
        notes += [f"{s.name}: {tok}: {n}" for n in loaded.notes]
    return list(dict.fromkeys(notes))  # a file several runs share is said once


def check_data_files(s: Scenario, runs: Runs | None = None) -> list[str]:
    """Refuse bad local rows, images or tokenizer files before any rank starts; returns what a
    user should know of them (a tokenizer's missing special tokens). ``runs``: each declared run
    with its effective ``[data]``, as the plan holds them (else worked out from ``s``)."""
    runs = runs if runs is not None else [(r, s.for_run(r).data) for r in s.runs]
    notes = check_tokenizers(s, runs)
    if s.model.vision:
        check_image_rows(s, runs)
    else:
        notes += check_text_rows(s, runs)
    return notes
