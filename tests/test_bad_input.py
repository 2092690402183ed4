"""Bad input never gets a traceback: a hand-written corpus through the CLI (exit 2, one line
naming the file, the key and what is wrong; ``--out`` untouched), and generated scenarios
(hypothesis) through the loader and the pre-launch checks, which either accept a scenario or
refuse it with one ``ScenarioError`` line."""

from __future__ import annotations

import json
import os
import signal
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.present import cli as cli_module
from harness.scenario import ScenarioError, load_scenario
from tests.conftest import write_scenario

hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")

JSONL = '[data]\nsource = "jsonl"\npath = "rows.jsonl"\nrows = 8\n'


def _base(d: Path, extra: str = "", world_sizes: tuple[int, ...] = (1, 2)) -> Path:
    return write_scenario(d, "bad", world_sizes=world_sizes, extra=extra)


def _edit(d: Path, old: str, new: str) -> Path:
    path = _base(d)
    body = path.read_text()
    assert old in body, old
    path.write_text(body.replace(old, new, 1))
    return path


def _rows(d: Path, data: bytes | str) -> Path:
    (d / "rows.jsonl").write_bytes(data if isinstance(data, bytes) else data.encode())
    return _edit(d, "[data]\nrows = 21\n", JSONL)


def _tokenizer(d: Path, content: str | None) -> Path:
    tok = d / "tokenizer.json"
    if content is None:
        tok.mkdir()
    else:
        tok.write_text(content)
    return _edit(d, "[data]\n", f'[data]\ntokenizer = "{tok}"\n')


def _images(d: Path) -> Path:
    (d / "fake.png").write_text("this is text, not a PNG")
    (d / "rows.jsonl").write_text(json.dumps({"image": "fake.png", "caption": "a red circle"}) + "\n")
    path = _edit(d, 'arch = "qwen3"', 'arch = "qwen2_vl"')
    path.write_text(path.read_text().replace("[data]\nrows = 21\n", JSONL))
    return path


def _fewer_rows(d: Path, data: str) -> Path:
    path = _base(d, world_sizes=(1, 4))
    path.write_text(path.read_text().replace("rows = 21", data, 1))
    return path


def _image_row(d: Path, row: Any) -> Path:
    path = _images(d)
    (d / "rows.jsonl").write_text(json.dumps(row) + "\n")
    return path


def _result(d: Path, text: str, name: str = "result.json") -> Path:
    (d / name).write_text(text)
    return d / name


GOOD_RESULT = {"schema_version": 2, "environment": {"platform": "x"}, "scenarios": []}

# (name, make the input in a directory -> CLI arguments, what the one line must say)
CORPUS: list[tuple[str, Callable[[Path], list[str]], str]] = [
    ("missing scenario", lambda d: ["run", str(d / "nope.toml")], "scenario file not found"),
    ("directory without default scenarios", lambda d: ["run", str(d)], "no scenario with default = true"),
    ("malformed TOML", lambda d: ["run", str(_edit(d, "seed = 7", "seed = = 7"))], "malformed TOML"),
    ("unknown table", lambda d: ["run", str(_base(d, "\n[trainning]\nsteps = 3\n"))], "trainning"),
    ("unknown key in [train]", lambda d: ["run", str(_edit(d, "steps = 4", "steps = 4\nstep = 3"))], "step"),
    ("unknown key in [model]", lambda d: ["run", str(_edit(d, 'arch = "qwen3"', 'arch = "qwen3"\nlayers = 2'))],
     "layers"),
    ("unknown key in a run", lambda d: ["run", str(_edit(d, "world_size = 2", "world_size = 2\nranks = 2"))],
     "ranks"),
    ("mistyped steps", lambda d: ["run", str(_edit(d, "steps = 4", 'steps = "four"'))], "steps"),
    ("mistyped seed", lambda d: ["run", str(_edit(d, "seed = 7", "seed = [7]"))], "seed"),
    ("zero steps", lambda d: ["run", str(_edit(d, "steps = 4", "steps = 0"))], "steps"),
    ("negative batch", lambda d: ["run", str(_edit(d, "global_batch = 6", "global_batch = -6"))], "global_batch"),
    ("world size 0", lambda d: ["run", str(_edit(d, "world_size = 2", "world_size = 0"))], "world_size"),
    ("world size too big", lambda d: ["run", str(_base(d, world_sizes=(1, 9)))], "world_size: 9 exceeds"),
    ("unknown arch", lambda d: ["run", str(_edit(d, 'arch = "qwen3"', 'arch = "gpt9"'))], "arch"),
    ("duplicate run names", lambda d: ["run", str(_edit(d, 'name = "ddp2"', 'name = "single"'))], "single"),
    ("reference not a run", lambda d: ["run", str(_edit(d, 'reference = "single"', 'reference = "solo"'))],
     "solo"),
    ("fault on a rank the run lacks",
     lambda d: ["run", str(_base(d, '\n[[faults]]\nrank = 3\nstep = 1\naction = "raise"\nruns = ["ddp2"]\n'))],
     "[[faults]][0].rank: rank 3 is not a rank of run ddp2"),
    ("rows file missing", lambda d: ["run", str(_edit(d, "[data]\nrows = 21\n", JSONL))], "path does not exist"),
    ("rows file is a directory", lambda d: ["run", str(_edit(d, "[data]\nrows = 21\n",
                                                             JSONL.replace("rows.jsonl", str(d))))],
     "is a directory"),
    ("rows not JSON", lambda d: ["run", str(_rows(d, '{"text": "fine row"}\n{"text": \n'))], "rows.jsonl:2: not JSON"),
    ("rows of the wrong shape", lambda d: ["run", str(_rows(d, '{"text": "fine row"}\n[1, 2]\n'))],
     "rows.jsonl:2: expected a row"),
    ("rows that are JSON arrays", lambda d: ["run", str(_rows(d, '[1, 2]\n[3, 4]\n'))],
     'rows.jsonl:1: expected a JSON object with a "text" string'),
    ("rows of no known form", lambda d: ["run", str(_rows(d, '{"txt": "a row"}\n'))], "rows.jsonl:1: expected"),
    ("image row without a caption", lambda d: ["run", str(_image_row(d, {"image": "fake.png", "title": "x"}))],
     'needs a "caption" string or a "messages" list'),
    ("image row whose prompt is a number",
     lambda d: ["run", str(_image_row(d, {"image": "fake.png", "caption": "x", "prompt": 3}))],
     '"prompt" must be a string'),
    ("more ranks than rows", lambda d: ["run", str(_fewer_rows(d, "rows = 3"))],
     "[[runs]][1].world_size: 4 ranks but [data].rows is 3: every rank needs rows of its own"),
    ("more ranks than eval rows", lambda d: ["run", str(_fewer_rows(d, "rows = 21\neval_rows = 2"))],
     "[[runs]][1].world_size: 4 ranks but [data].eval_rows is 2"),
    ("a rows file of fewer rows than ranks", lambda d: ["run", str(_rows(d, '{"text": "one row only"}\n'))],
     "rows.jsonl holds 1 row: every rank needs rows of its own"),
    ("rows of mixed forms", lambda d: ["run", str(_rows(d, '{"text": "a row"}\n{"prompt": "q", "completion": "a"}\n'))],
     "rows.jsonl:2"),
    ("rows not UTF-8", lambda d: ["run", str(_rows(d, b'{"text": "caf\xe9 au lait"}\n'))], "not UTF-8"),
    ("rows file empty", lambda d: ["run", str(_rows(d, ""))], "has no rows"),
    ("chat row without a reply", lambda d: ["run", str(_rows(d, json.dumps(
        {"messages": [{"role": "user", "content": "hi"}]}) + "\n"))], "at least one assistant message"),
    ("tokenizer not JSON", lambda d: ["run", str(_tokenizer(d, "{not json"))], "not a usable tokenizer.json"),
    ("tokenizer of another shape", lambda d: ["run", str(_tokenizer(d, '{"model": 5}'))],
     "not a usable tokenizer.json"),
    ("tokenizer is a directory", lambda d: ["run", str(_tokenizer(d, None))], "tokenizer"),
    ("image that is not an image", lambda d: ["run", str(_images(d))], "is not an image Pillow can read"),
    ("result file truncated", lambda d: ["report", str(_result(d, json.dumps(GOOD_RESULT)[:12]))], "result.json"),
    ("result without its environment", lambda d: ["report", str(_result(d, '{"schema_version": 2, "scenarios": []}'))],
     "no \"environment\" table"),
    ("result with a broken scenario",
     lambda d: ["report", str(_result(d, json.dumps({**GOOD_RESULT, "scenarios": [{}]})))],
     "scenarios[0] is not a scenario result (no name, runs)"),
    ("result of another schema",
     lambda d: ["report", str(_result(d, json.dumps({**GOOD_RESULT, "schema_version": 1})))], "schema_version 1"),
    ("baseline truncated", lambda d: ["gate", str(_result(d, json.dumps(GOOD_RESULT))), "--baseline",
                                      str(_result(d, '{"platform"', "base.json"))], "base.json"),
    ("baseline of another schema", lambda d: ["gate", str(_result(d, json.dumps(GOOD_RESULT))), "--baseline",
                                              str(_result(d, '{"schema_version": 99}', "base.json"))], "base.json"),
    ("baseline missing", lambda d: ["gate", str(_result(d, json.dumps(GOOD_RESULT))), "--baseline", str(d / "nope")],
     "nope"),
]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """The CLI in this process (its SIGTERM handler restored after)."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = cli_module.main(argv)
    finally:
        signal.signal(signal.SIGTERM, before)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(("name", "make", "needle"), CORPUS, ids=[c[0] for c in CORPUS])
def test_bad_input_exits_2_with_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture, name: str,
                                                    make: Callable[[Path], list[str]], needle: str) -> None:
    d = tmp_path / "in"
    d.mkdir()
    argv = make(d)
    out = tmp_path / "out"
    out.mkdir()
    (out / "result.json").write_text("previous")
    if argv[0] == "run":
        argv += ["--out", str(out)]
    code, stdout, stderr = run_cli(argv, capsys)
    assert code == 2, (name, stdout[-2000:], stderr[-2000:])
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (name, stderr)
    assert "Traceback" not in stderr + stdout
    assert (out / "result.json").read_text() == "previous"


def test_an_unknown_ring_yield_setting_is_refused_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_DDP_HARNESS_RING_YIELD", "sometimes")
    example = Path(__file__).resolve().parents[1] / "examples" / "minimal_parity.toml"
    code, stdout, stderr = run_cli(["run", str(example), "--out", str(tmp_path / "out")], capsys)
    assert code == 2, stdout[-2000:] + stderr[-2000:]
    assert stderr.strip() == "error: MLX_DDP_HARNESS_RING_YIELD='sometimes': use one of auto, on, off"
    assert not (tmp_path / "out").exists()  # refused before anything ran or was written


# Generated scenarios: a valid one with one key set, at any level, to a generated value.
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True),
                   st.text(max_size=12), st.lists(st.integers(-2, 5), max_size=3),
                   st.dictionaries(st.sampled_from(["x", "rows", "kind"]), st.integers(-1, 3), max_size=2))
TABLES = {
    "scenario": ["name", "seed", "kind", "default", "description"],
    "model": ["arch", "dtype", "hidden_size", "num_hidden_layers", "vocab_size"],
    "data": ["rows", "format", "source", "path", "tokenizer", "max_seq_len", "order", "eval_rows", "max_chars"],
    "train": ["steps", "global_batch", "grad_accum", "learning_rate", "compile", "eval_every", "checkpoint_every"],
    "checks": ["reference", "floor_ratio", "max_rss_mb", "loss_tolerance", "probe_every", "expected_failures"],
    "limits": ["wall_s", "no_progress_s", "hard_rss_mb", "hard_memory_factor", "machine_memory_fraction"],
    "trainer": ["kind", "path"],
}
TRIED = {"accepted": 0, "refused": 0}


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return "nan" if value != value else ("inf" if value == float("inf") else "-inf" if value == -float("inf")
                                              else repr(value))
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return str(value)


@hypothesis.settings(max_examples=300, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(table=st.sampled_from(sorted(TABLES) + ["runs", "faults", "nonsense"]),
                  key=st.one_of(st.sampled_from(sorted({k for ks in TABLES.values() for k in ks} | {"world_size"})),
                                st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=10)),
                  value=VALUES)
def test_generated_scenarios_are_accepted_or_refused_with_one_line(tmp_path: Path, table: str, key: str,
                                                                    value: Any) -> None:
    from harness.controller.preflight import preflight
    from harness.scenario.plan import plan_scenario

    path = _base(tmp_path)
    body = path.read_text()
    line = f"{key} = {_toml(value)}"
    if value is None:  # TOML has no null: drop the key instead
        body = "\n".join(ln for ln in body.splitlines() if not ln.startswith(f"{key} ="))
    elif table == "runs":
        body = body.replace("world_size = 2\n", f"world_size = 2\n{line}\n", 1)
    elif table == "faults":
        body += f'\n[[faults]]\nrank = 1\nstep = 1\naction = "raise"\n{line}\n'
    elif f"[{table}]\n" in body:
        body = body.replace(f"[{table}]\n", f"[{table}]\n{line}\n", 1)
    else:
        body += f"\n[{table}]\n{line}\n"
    path.write_text(body)
    try:
        tomllib.loads(body)
    except tomllib.TOMLDecodeError:
        pass  # the loader must say so too
    try:
        s = load_scenario(path)
        preflight(plan_scenario(s), None)
        TRIED["accepted"] += 1
    except ScenarioError as e:
        TRIED["refused"] += 1
        message = str(e)
        assert "\n" not in message.strip() and message.strip(), message
        assert str(path) in message or path.name in message or "rows" in message or "tokenizer" in message, message
    if os.environ.get("MLX_DDP_HARNESS_SHOW_TRIED"):
        print(TRIED)


# Generated rows: any JSON a line of a rows file can hold, for text and for image rows. The
# pre-launch check reads them as the ranks do and either accepts them or refuses them in one line.
ROW_KEYS = st.sampled_from(["text", "prompt", "completion", "messages", "role", "content", "image", "caption", "x"])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.sampled_from(["user", "assistant", "system", "fake.png"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ROW_KEYS, inner, max_size=4), max_leaves=10)


@hypothesis.settings(max_examples=300, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(rows=st.lists(JSON_VALUES, min_size=1, max_size=3), vision=st.booleans())
def test_generated_rows_are_accepted_or_refused_with_one_line(tmp_path: Path, rows: list[Any], vision: bool) -> None:
    from harness.controller.input_checks import check_data_files

    d = tmp_path / f"rows{vision}"
    d.mkdir(exist_ok=True)
    path = _images(d) if vision else _rows(d, "")
    if vision:
        from PIL import Image

        Image.new("RGB", (32, 32), "red").save(d / "fake.png")
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = load_scenario(path)
    try:
        check_data_files(s)
    except ScenarioError as e:
        message = str(e).strip()
        assert message and "\n" not in message and "rows.jsonl" in message, message  # the file, and its line
