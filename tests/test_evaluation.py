"""Evaluation: accuracy, loss, per-class accuracy on a split; RS expected accuracy (SPEC §4)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional

from dpmerge.artifacts import ModelSpec
from dpmerge.data import Split, load_dataset
from dpmerge.errors import DatasetError, RecordError
from dpmerge.evaluation import evaluate, expected_accuracy
from dpmerge.models import build_model

SPEC = ModelSpec("logreg", (2,), 3)
# The model predicts the larger of the two features (class 2 never predicted, never present).
WEIGHTS = {
    "linear.weight": torch.tensor([[1.0, 0.0], [0.0, 1.0], [-5.0, -5.0]]),
    "linear.bias": torch.zeros(3),
}
SPLIT = Split(
    torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, 1.0], [0.5, 0.0]]),
    torch.tensor([0, 1, 1, 1, 0]),
)


def test_accuracy_loss_and_per_class_accuracy_match_hand_computation() -> None:
    result = evaluate((SPEC, WEIGHTS), SPLIT)
    logits = SPLIT.features @ WEIGHTS["linear.weight"].T
    assert result["n"] == 5
    assert result["accuracy"] == pytest.approx(4 / 5)
    assert result["loss"] == pytest.approx(float(functional.cross_entropy(logits, SPLIT.labels)))
    assert result["per_class_accuracy"] == [1.0, pytest.approx(2 / 3), None]


@pytest.mark.parametrize("batch_size", [1, 2, 1000])
def test_batch_size_does_not_change_the_result(batch_size: int) -> None:
    batched, whole = (
        evaluate((SPEC, WEIGHTS), SPLIT, batch_size=batch_size),
        evaluate((SPEC, WEIGHTS), SPLIT),
    )
    assert batched["loss"] == pytest.approx(whole["loss"])
    assert {**batched, "loss": None} == {**whole, "loss": None}


def test_a_module_is_evaluated_in_eval_mode_and_its_mode_restored() -> None:
    module = build_model(SPEC)
    module.load_state_dict(WEIGHTS)
    module.train()
    assert evaluate(module, SPLIT) == evaluate((SPEC, WEIGHTS), SPLIT)
    assert module.training


def test_zero_logistic_regression_on_digits_predicts_class_zero() -> None:
    data = load_dataset("digits")
    spec = ModelSpec("logreg", data.input_shape, data.num_classes)
    zero = {k: torch.zeros_like(v) for k, v in build_model(spec).state_dict().items()}
    result = evaluate((spec, zero), data.test)
    labels = data.test.labels
    assert result["n"] == len(labels)
    assert result["accuracy"] == pytest.approx(float((labels == 0).float().mean()))
    assert result["loss"] == pytest.approx(math.log(10))
    assert result["per_class_accuracy"] == [1.0] + [0.0] * 9


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(RecordError, match=r"missing linear\.bias"):
        evaluate((SPEC, {"linear.weight": WEIGHTS["linear.weight"]}), SPLIT)
    with pytest.raises(DatasetError, match="input shape"):
        evaluate((ModelSpec("logreg", (3,), 3), WEIGHTS), SPLIT)
    with pytest.raises(DatasetError, match="empty split"):
        evaluate((SPEC, WEIGHTS), Split(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long)))
    with pytest.raises(DatasetError, match="labels outside"):
        evaluate((SPEC, WEIGHTS), Split(SPLIT.features, torch.tensor([0, 1, 3, 1, 0])))


def test_expected_accuracy_is_the_pi_weighted_mean() -> None:
    assert expected_accuracy([0.9, 0.8, 0.5], [0.5, 0.5, 0.0]) == pytest.approx(0.85)
    with pytest.raises(RecordError, match="simplex"):
        expected_accuracy([0.9, 0.8], [0.5, 0.6])
    with pytest.raises(RecordError, match="expected 2 values"):
        expected_accuracy([0.9, 0.8], [1.0])
