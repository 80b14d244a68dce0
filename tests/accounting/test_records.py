"""Mechanism records and the candidates file: validation names the offending field."""

from __future__ import annotations

import json

import pytest
from factories import make_record

from dpmerge.accounting.records import (
    PrivacyLabel,
    candidate_from_dict,
    candidates_to_document,
    load_candidates,
)
from dpmerge.errors import RecordError


def record_dict(**overrides):
    data = make_record("a", 1.0).model_dump(mode="json", exclude_none=True)
    data.update(overrides)
    return data


def test_round_trip_through_the_candidates_file(tmp_path, ladder):
    label = PrivacyLabel(name="vendor", dataset=ladder[0].dataset, epsilon=1.0, delta=1e-6)
    path = tmp_path / "candidates.json"
    path.write_text(json.dumps(candidates_to_document([*ladder, label])))
    assert load_candidates(path) == (*ladder, label)


@pytest.mark.parametrize(
    "field",
    [
        "noise_multiplier",
        "sample_rate",
        "steps",
        "noise_lineage",
        "batch_lineage",
        "optimizer",
        "dataset",
        "neighbouring",
        "sampling",
        "expected_batch_size",
    ],
)
def test_a_missing_field_is_named(field):
    data = record_dict()
    del data[field]
    with pytest.raises(RecordError, match=f"'{field}'"):
        candidate_from_dict(data)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("noise_multiplier", -1.0, "greater than or equal to 0.1"),
        ("noise_multiplier", 1e-300, "greater than or equal to 0.1"),
        ("noise_multiplier", True, "valid number"),
        ("noise_multiplier", "1.0", "valid number"),
        ("steps", True, "valid integer"),
        ("steps", "500", "valid integer"),
        ("steps", 500.0, "valid integer"),
        ("steps", 10**12, "less than or equal to"),
        ("sample_rate", False, "valid number"),
        ("clip_norm", None, "valid number"),
        ("dataset_size", 6e4, "valid integer"),
        ("name", 7, "valid string"),
        ("run_id", 12, "valid string"),
        ("sample_rate", 1.5, "less than or equal to 1"),
        ("steps", 0, "greater than 0"),
        ("neighbouring", "replace_one", "add_or_remove_one.*replace-one DP-SGD needs twice"),
        ("neighbouring", "add-or-remove-one", "'add_or_remove_one'.*spelt with underscores"),
        ("sampling", "shuffle", "poisson"),
        ("optimizer", "lbfgs", "optimizer"),
        ("noise_multiplier", float("nan"), "noise_multiplier"),
    ],
)
def test_a_wrong_value_is_named(field, value, message):
    with pytest.raises(RecordError, match=message):
        candidate_from_dict(record_dict(**{field: value}))


def test_unknown_fields_and_shapes_are_refused(tmp_path):
    with pytest.raises(RecordError, match="unknown field 'colour'"):
        candidate_from_dict(record_dict(colour="red"))
    with pytest.raises(RecordError, match="neither a DP-SGD record"):
        candidate_from_dict({"name": "x"})
    with pytest.raises(RecordError, match="'delta'"):
        candidate_from_dict({"name": "x", "epsilon": 1.0, "dataset": "d"})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(RecordError, match="not valid"):
        load_candidates(bad)
    bad.write_text('{"candidates": []}')
    with pytest.raises(RecordError, match="empty"):
        load_candidates(bad)
    with pytest.raises(RecordError, match="not found"):
        load_candidates(tmp_path / "missing.json")
    bad.write_text(json.dumps({"candidates": [record_dict(), record_dict()]}))
    with pytest.raises(RecordError, match="unique"):
        load_candidates(bad)
    with pytest.raises(RecordError, match="is a directory"):
        load_candidates(tmp_path)
    bad.write_text('{"candidates": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(RecordError, match="nested too deeply"):
        load_candidates(bad)


def test_labels_are_strictly_typed():
    base = {"name": "v", "dataset": "d", "epsilon": 1.0, "delta": 1e-6}
    for field, value in (("epsilon", True), ("delta", "1e-6"), ("epsilon", 1e6)):
        with pytest.raises(RecordError, match=field):
            candidate_from_dict({**base, field: value})
    with pytest.raises(RecordError, match="rdp_epsilons"):
        candidate_from_dict(
            {"name": "v", "dataset": "d", "rdp_orders": [2.0], "rdp_epsilons": [False]}
        )


def test_duplicate_names_are_found_in_linear_time(tmp_path):
    """100 000 candidates with one repeated name: validation is linear (a quadratic check
    spends minutes here) and the message names the repeat once."""
    data = record_dict()
    items = [{**data, "name": f"c{i}"} for i in range(100_000)]
    items[-1]["name"] = "c7"
    path = tmp_path / "many.json"
    path.write_text(json.dumps({"candidates": items}))
    with pytest.raises(RecordError, match=r"repeated: 'c7'$"):
        load_candidates(path)


def test_records_are_frozen_and_hashable():
    record = make_record("a", 1.0)
    assert hash(record) == hash(make_record("a", 1.0))
    with pytest.raises(Exception, match="frozen"):
        record.steps = 3  # type: ignore[misc]
