"""Scenario files: TOML that reads like a test description, parsed into the specs of
``harness.scenario.spec`` (its sections, keys and value types, its paths resolved) and checked
by ``harness.scenario.rules`` (its values).

Every error names the file and the key (``ScenarioError``), so the CLI can print one line.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from harness.scenario.names import DATA_MUTATIONS, MUTATION_SETS
from harness.scenario.rules import validate
from harness.scenario.spec import (
    CheckSpec,
    DataSpec,
    FaultSpec,
    LimitSpec,
    ModelSpec,
    RunSpec,
    Scenario,
    ScenarioError,
    TrainerSpec,
    TrainSpec,
    compared,
)
from harness.scenario.trainers import trainer_info

HEAD_KEYS = ("name", "description", "seed", "default", "full", "kind", "extends")  # [scenario]
OWN_HEAD_KEYS = ("name", "default", "full")  # what a file extending another never inherits



def _type_ok(value: Any, annotation: str) -> bool:
    kinds = {
        "str": (str,),
        "int": (int,),
        "float": (int, float),
        "bool": (bool,),
        "dict[str, Any]": (dict,),
        "list[str]": (list,),
    }
    optional = annotation.endswith(" | None")
    base = annotation.removesuffix(" | None")
    if value is None:
        return optional
    if isinstance(value, bool) and base != "bool":
        return False
    if base == "list[str]":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, kinds[base])


def _coerce(cls: type, table: Any, where: str, src: str) -> dict[str, Any]:
    """Check a TOML table's keys and value types against ``cls``'s fields."""
    if not isinstance(table, dict):
        raise ScenarioError(f"{src}: {where} must be a table")
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key not in known:
            raise ScenarioError(f"{src}: {where}.{key}: unknown key (known: {', '.join(known)})")
        if not _type_ok(value, str(known[key].type)):
            raise ScenarioError(f"{src}: {where}.{key}: expected {known[key].type}, got {value!r}")
        kwargs[key] = float(value) if known[key].type.startswith("float") and value is not None else value
    return kwargs


def _build(cls: type, table: Any, where: str, src: str) -> Any:
    kwargs = _coerce(cls, table, where, src)
    missing = [
        f.name
        for f in fields(cls)
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in kwargs
    ]
    if missing:
        raise ScenarioError(f"{src}: {where}.{missing[0]}: required key is missing")
    return cls(**kwargs)


def _resolve(path: str | None, base: Path, src: str, key: str) -> str | None:
    if path is None:
        return None
    if "{rank}" in path:
        raise ScenarioError(f"{src}: {key}: {path!r} is sharded per rank by the caller; give the whole dataset "
                            f"(each rank takes its own share)")
    p = (base / path).resolve() if not Path(path).is_absolute() else Path(path)
    if not p.exists():
        raise ScenarioError(f"{src}: {key}: path does not exist: {p}")
    return str(p)


def is_named_tokenizer(value: Any) -> bool:
    """``byte``, or ``bpe:N`` (trained at run time): a tokenizer named, not a file."""
    return isinstance(value, str) and (value == "byte" or value.startswith("bpe:"))


def _cluster(table: Any, src: str, base: Path) -> dict[str, Any] | None:
    """``[cluster]``, checked as a hostfile is (``hostfile`` or ``hosts``, ``python``, ``workdir``)."""
    if table is None:
        return None
    from harness.cluster_spec import ClusterError, from_mapping

    if not isinstance(table, dict):
        raise ScenarioError(f"{src}: [cluster]: must be a table")
    try:
        from_mapping(table, f"{src}: [cluster]", base)
    except ClusterError as e:
        raise ScenarioError(str(e)) from e
    return dict(table)


def parse_scenario(data: dict[str, Any], src: str, base: Path) -> Scenario:
    """Build and validate a scenario from parsed TOML; ``src`` names the file in errors."""
    top = {"scenario", "trainer", "model", "data", "train", "checks", "limits", "runs", "faults", "cluster"}
    for key in data:
        if key not in top:
            raise ScenarioError(f"{src}: [{key}]: unknown section (known: {', '.join(sorted(top))})")
    head = data.get("scenario")
    if not isinstance(head, dict):
        raise ScenarioError(f"{src}: [scenario]: section is missing")
    for key in head:
        if key not in HEAD_KEYS:
            raise ScenarioError(f"{src}: [scenario].{key}: unknown key (known: {', '.join(sorted(HEAD_KEYS))})")
    if "extends" in head:
        raise ScenarioError(f"{src}: [scenario].extends: only a scenario file can extend another (its path "
                            f"resolves from the file's directory)")
    default = head.get("default", False)

    def many(key: str, cls: type) -> list[Any]:
        items = data.get(key, [])
        if not isinstance(items, list):
            raise ScenarioError(f"{src}: [[{key}]]: must be an array of tables")
        return [_build(cls, t, f"[[{key}]][{i}]", src) for i, t in enumerate(items)]

    s = Scenario(
        name=head.get("name"),
        description=head.get("description", ""),
        seed=head.get("seed", 0),
        default=default,
        full=head.get("full", default),
        kind=head.get("kind", "parity"),
        trainer=_build(TrainerSpec, data.get("trainer", {}), "[trainer]", src),
        model=_build(ModelSpec, data.get("model", {}), "[model]", src),
        data=_build(DataSpec, data.get("data", {}), "[data]", src),
        train=_build(TrainSpec, data.get("train", {}), "[train]", src),
        checks=_build(CheckSpec, data.get("checks", {}), "[checks]", src),
        limits=_build(LimitSpec, data.get("limits", {}), "[limits]", src),
        runs=many("runs", RunSpec),
        faults=many("faults", FaultSpec),
        path=src,
        cluster=_cluster(data.get("cluster"), src, base),
    )
    for i, r in enumerate(s.runs):
        r.train = _coerce(TrainSpec, r.train, f"[[runs]][{i}].train", src)
        r.data = _coerce(DataSpec, r.data, f"[[runs]][{i}].data", src)
        r.trainer = _coerce(TrainerSpec, r.trainer, f"[[runs]][{i}].trainer", src)
        if "path" in r.trainer:
            r.trainer["path"] = _resolve(r.trainer["path"], base, src, f"[[runs]][{i}].trainer.path")
        for key in ("path", "eval_path", "tokenizer"):
            if key in r.data and not is_named_tokenizer(r.data[key]):
                r.data[key] = _resolve(r.data[key], base, src, f"[[runs]][{i}].data.{key}")
        if r.resume_from is not None and r.resume_from not in [run.name for run in s.runs]:
            r.resume_from = _resolve(r.resume_from, base, src, f"[[runs]][{i}].resume_from")
    s.model.path = _resolve(s.model.path, base, src, "[model].path")
    s.trainer.path = _resolve(s.trainer.path, base, src, "[trainer].path")
    s.data.path = _resolve(s.data.path, base, src, "[data].path")
    s.data.eval_path = _resolve(s.data.eval_path, base, src, "[data].eval_path")
    if not is_named_tokenizer(s.data.tokenizer):
        s.data.tokenizer = _resolve(s.data.tokenizer, base, src, "[data].tokenizer")
    s.runs += mutation_runs(s, src)
    validate(s, src)
    return s


def mutation_runs(s: Scenario, src: str) -> list[RunSpec]:
    """``[checks] mutations``: one run per mutation of the set (and ``same_rows`` where the trainer
    feeds its rows through the harness), each a copy of the first run of two or more ranks
    compared with the reference (not resumed, stopped early or mutated already)."""
    asked = s.checks.mutations
    if asked is None:
        return []
    key = "[checks].mutations"
    if asked not in MUTATION_SETS:
        raise ScenarioError(f"{src}: {key}: {asked!r} is not one of {', '.join(MUTATION_SETS)}")
    info = trainer_info(s.trainer.kind)
    if not info.external or info.command:
        raise ScenarioError(f"{src}: {key}: the {info.kind} trainer takes no collective mutation "
                            + ("(its all-reduce is its own: list its bugs as [[runs]] mutation)" if not info.external
                               else "(an executable's collectives are not MLX's Python calls)"))
    base = next((r for r in s.runs if r.world_size >= 2 and compared(s, r) and r.mutation is None
                 and r.resume_from is None and r.stop_after is None), None)
    if base is None:
        raise ScenarioError(f"{src}: {key}: no run to mutate: it copies the first run of world_size >= 2 compared "
                            f"with [checks].reference")
    wanted = MUTATION_SETS[asked] + (tuple(DATA_MUTATIONS) if info.feeds_rows else ())
    taken = {r.name for r in s.runs}
    clash = [m for m in wanted if m in taken]
    if clash:
        raise ScenarioError(f"{src}: {key}: a run is already named {clash[0]!r} (the mutated runs take their "
                            f"mutations' names)")
    return [dataclasses.replace(base, name=m, mutation=m, compare_to=None) for m in wanted]


def _read(p: Path) -> dict[str, Any]:
    if not p.is_file():
        raise ScenarioError(f"{p}: scenario file not found")
    try:
        return tomllib.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ScenarioError(f"{p}: unreadable ({e})") from e
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{p}: malformed TOML ({e})") from e


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``: tables key by key, anything else (arrays of runs, faults) replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def extended(data: dict[str, Any], p: Path) -> tuple[dict[str, Any], Path]:
    """A file with ``[scenario] extends = "OTHER.toml"`` is that scenario with this file's tables
    laid over it (its name, ``default`` and ``full`` are its own); paths in either resolve from
    the extended file's directory. One level: the extended file extends nothing."""
    head = data.get("scenario")
    if not isinstance(head, dict) or "extends" not in head:
        return data, p.parent
    other = head["extends"]
    if not isinstance(other, str):
        raise ScenarioError(f"{p}: [scenario].extends: expected a scenario file's path, got {other!r}")
    base_path = (p.parent / other).resolve()
    if not base_path.is_file():
        raise ScenarioError(f"{p}: [scenario].extends: scenario file not found: {base_path}")
    base = _read(base_path)
    if "extends" in (base.get("scenario") or {}):
        raise ScenarioError(f"{p}: [scenario].extends: {base_path.name} extends another file itself (one level only)")
    base_head = {k: v for k, v in (base.get("scenario") or {}).items() if k not in OWN_HEAD_KEYS}
    own = {k: v for k, v in head.items() if k != "extends"}
    return _merged({**base, "scenario": base_head}, {**data, "scenario": own}), base_path.parent


def load_scenario(path: Path | str) -> Scenario:
    """Read and validate one scenario file (and the file it ``extends``)."""
    p = Path(path)
    data, base = extended(_read(p), p)
    return parse_scenario(data, str(p), base)


def discover(directory: Path | str) -> list[Path]:
    """Scenario files in ``directory``, sorted by name."""
    return sorted(Path(directory).glob("*.toml"))


def with_device(s: Scenario, device: str | None) -> Scenario:
    """``s`` with every run on ``device`` (``--device``, ``--mlx-ddp-device``); ``None``: as written."""
    if device is None:
        return s
    runs = [dataclasses.replace(r, train={k: v for k, v in r.train.items() if k != "device"}) for r in s.runs]
    return dataclasses.replace(s, train=dataclasses.replace(s.train, device=device), runs=runs)
