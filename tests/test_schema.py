"""Rank results are typed (``schema.RankResult``, ``schema.TrainResult``), built by one builder
and read strictly: a missing or renamed key is an error naming it, never a default."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import schema
from harness.controller.collect import collect
from harness.controller.outcome import WatchReport
from tests.conftest import train_result


def test_the_builder_refuses_a_missing_or_unknown_key() -> None:
    fields = {k: v for k, v in train_result().items() if k not in schema.RankResult.__required_keys__}
    assert schema.train_result(**fields)["steps_start"] == 1
    with pytest.raises(TypeError, match="lacks steps_start"):
        schema.train_result(**{k: v for k, v in fields.items() if k != "steps_start"})
    with pytest.raises(TypeError, match="unknown keys step_start"):
        schema.train_result(**fields, step_start=1)


def test_a_result_with_a_renamed_key_is_refused_where_it_is_read(tmp_path: Path) -> None:
    good = train_result()
    renamed = {("first_step" if k == "steps_start" else k): v for k, v in good.items()}
    schema.write_json_atomic(schema.result_path(tmp_path, 0), schema.stamp(good))
    schema.write_json_atomic(schema.result_path(tmp_path, 1), schema.stamp(renamed))
    ranks = collect(tmp_path, 2, WatchReport(1.0, 0))
    assert ranks[0].result == schema.stamp(good)
    bad = ranks[1].result
    assert bad is not None and bad["status"] == "error" and "rank1.result.json: lacks steps_start" in bad["error"]
    # a result of another job kind (a launch probe) carries its own figures; one that failed, its error
    probe = {"rank": 0, "pid": 1, "host": "h", "job": "allsum", "status": "ok", "sum": 3.0}
    assert schema.check_rank_result(probe, "probe") == probe
    failed = {"rank": 0, "pid": 1, "host": "h", "job": "train", "status": "error", "error": "x", "traceback": "t"}
    assert schema.check_rank_result(failed, "failed") == failed


def test_an_event_is_checked_against_its_own_branch_with_the_whole_schemas_verdict() -> None:
    """``protocol_problem`` checks an event of a known kind against that kind's branch of the schema
    alone: every record gets the problem the whole schema names first (or none)."""
    from harness.schema import _protocol_validator, protocol_problem

    def whole(record: dict) -> str | None:
        errors = sorted(_protocol_validator("event").iter_errors(record), key=lambda e: list(e.path))
        return f"{'.'.join(map(str, errors[0].path)) or 'the record'}: {errors[0].message}" if errors else None

    step = {"protocol": 1, "kind": "step", "step": 3, "loss": 5.2, "tokens_global": 80, "tokens_local": 40}
    start = {"protocol": 1, "kind": "start", "rank": 0, "world_size": 2, "digest": "d", "dtypes": {"w": "bfloat16"}}
    records = [step, start, {**step, "loss": "x"}, {**step, "kind": "nope"}, {**step, "extra": 1}, {**step, "step": 0},
               {"protocol": 1, "kind": "start"}, {"protocol": 1, "kind": "eval", "step": 1}, {"protocol": 1, "kind": 5},
               {"protocol": 1}, {**start, "dtypes": {"w": 3}}, {**start, "dtypes": {"w": "BF16"}},
               {**start, "dtype": "int8"}]
    assert [protocol_problem("event", r) for r in records] == [whole(r) for r in records]
    assert protocol_problem("event", step) is None and protocol_problem("event", start) is None
    assert protocol_problem("event", {**step, "loss": "x"}) == "loss: 'x' is not of type 'number'"
    assert _protocol_validator("event", "step") is not None and _protocol_validator("event", "nope") is None
    assert protocol_problem("event", {**step, "protocol": True}) == "protocol True, the harness speaks 1"
