"""δ against the n training rows it protects (dpmerge.accounting.delta,
docs/design.md#mechanism-record): refused at 1/n or more, warned above 1/(10·n)."""

from __future__ import annotations

import pytest
from factories import make_record

from dpmerge.accounting.delta import DeltaError, check_delta_against, delta_check_for
from dpmerge.accounting.records import PrivacyLabel
from dpmerge.errors import RecordError


def test_a_delta_of_one_over_n_or_more_is_refused_naming_n() -> None:
    for delta in (1 / 54_000, 1e-3, 0.5):
        with pytest.raises(DeltaError, match=r"not below 1/n = 1\.85e-05 for n = 54,000"):
            check_delta_against(delta, 54_000)


def test_a_delta_between_the_bounds_passes_with_a_warning() -> None:
    n = 54_000
    assert check_delta_against(0.999 / n, n).warning.startswith("warning: δ = ")
    assert "above 1/(10·n) = 1.85e-06 for n = 54,000" in check_delta_against(1e-5, n).warning
    assert check_delta_against(1 / (10 * n), n).warning is None
    assert check_delta_against(1e-7, n).to_dict() == {
        "delta": 1e-7,
        "dataset_size": n,
        "warning": None,
        "note": None,
    }


def test_without_a_dataset_size_delta_is_checked_for_range_and_said_so() -> None:
    label = PrivacyLabel(name="vendor", dataset="d", epsilon=1.0, delta=1e-6)
    unchecked = delta_check_for([label, make_record("a", 1.0, dataset_size=None)], 0.5)
    assert unchecked.dataset_size is None and unchecked.warning is None
    assert unchecked.note == (
        "δ = 0.5 was not checked against the dataset size: no candidate record carries dataset_size"
    )
    for bad in (True, "1e-5", 0.0, 1.0, float("nan")):
        with pytest.raises(RecordError):
            check_delta_against(bad, 100)  # type: ignore[arg-type]


def test_the_smallest_dataset_size_of_the_records_decides() -> None:
    records = [make_record("a", 1.0, dataset_size=60_000), make_record("b", 1.0, dataset_size=900)]
    with pytest.raises(DeltaError, match="n = 900"):
        delta_check_for(records, 2e-3)
    assert delta_check_for(records, 1e-4).dataset_size == 900


def test_a_given_dataset_size_is_checked_and_never_loosens_the_records() -> None:
    unsized = [make_record("a", 1.0, dataset_size=None)]
    with pytest.raises(DeltaError, match="n = 10,000"):
        delta_check_for(unsized, 0.5, 10_000)
    assert delta_check_for(unsized, 1e-6, 10_000).dataset_size == 10_000
    sized = [make_record("a", 1.0, dataset_size=900)]
    with pytest.raises(DeltaError, match="n = 900"):
        delta_check_for(sized, 2e-3, 100)  # a smaller given n does not loosen n = 900
    with pytest.raises(DeltaError, match="n = 1,000,000"):
        delta_check_for(sized, 1e-5, 1_000_000)  # δ must pass the given n too
    assert delta_check_for(sized, 1e-5, 100).dataset_size == 900
    with pytest.raises(DeltaError, match="give --dataset-size"):
        delta_check_for(unsized, 1e-6, required=True)
    for bad in (True, 0, -3, 2.0):
        with pytest.raises(RecordError, match="dataset size"):
            delta_check_for(unsized, 1e-6, bad)  # type: ignore[arg-type]
