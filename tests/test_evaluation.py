"""Evaluation: accuracy, loss, per-class accuracy on a split; RS expected accuracy
(docs/design.md#random-selection)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.nn import functional

from dpmerge.artifacts import WEIGHTS_FILE, ModelSpec, load_model_dir
from dpmerge.data import DatasetSplits, Split, load_dataset
from dpmerge.errors import DatasetError, RecordError
from dpmerge.evaluation import MergeAccuracy, evaluate, expected_accuracy
from dpmerge.merging import merge_model_dirs
from dpmerge.models import build_model
from dpmerge.training import TrainConfig, save_candidate, train_candidate

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


@pytest.fixture(scope="module")
def cnn_candidates(tmp_path_factory: pytest.TempPathFactory) -> tuple[DatasetSplits, list[Path]]:
    data = load_dataset("digits")
    root = tmp_path_factory.mktemp("candidates")
    paths = []
    for i, sigma in enumerate((0.8, 1.3, 2.0)):
        config = TrainConfig(
            "digits", "cnn", noise_multiplier=sigma, batch_size=64, max_steps=8, init_seed=i
        )
        paths.append(save_candidate(train_candidate(config, data), root / f"c{i}", 1e-5))
    return data, paths


def test_merge_accuracy_is_the_accuracy_of_the_released_merge(
    cnn_candidates: tuple[DatasetSplits, list[Path]], tmp_path: Path
) -> None:
    data, paths = cnn_candidates
    weights = (0.3, 0.45, 0.25)
    released = merge_model_dirs(paths, "lc", weights, tmp_path / "merged", delta=1e-5)
    saved = load_model_dir(released.path)
    merges = MergeAccuracy(saved.spec, [p / WEIGHTS_FILE for p in paths])
    merged = merges.merged(weights)
    assert merged.keys() == saved.weights.keys()
    assert all(torch.equal(merged[k], saved.weights[k]) for k in merged)  # bit for bit
    ours, theirs = build_model(saved.spec), build_model(saved.spec)
    ours.load_state_dict(merged)
    theirs.load_state_dict(saved.weights)
    for split in (data.validation, data.test):
        with torch.inference_mode():
            logits = ours.eval()(split.features)
            assert torch.equal(logits, theirs.eval()(split.features))
        accuracy = merges.accuracy(weights, split)
        assert accuracy == evaluate((saved.spec, saved.weights), split)["accuracy"]
        assert accuracy == int((logits.argmax(1) == split.labels).sum()) / len(split)
    # the arithmetic calibration used before (float64 in memory, then cast) releases other bits
    states = [load_model_dir(p).weights for p in paths]
    in_float64 = {
        k: sum(w * s[k].double() for w, s in zip(weights, states, strict=True)).float()
        for k in merged
    }
    assert not all(torch.equal(in_float64[k], merged[k]) for k in merged)


def test_merge_accuracy_is_cached_by_weights_and_split(
    cnn_candidates: tuple[DatasetSplits, list[Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    data, paths = cnn_candidates
    merges = MergeAccuracy(load_model_dir(paths[0]).spec, [p / WEIGHTS_FILE for p in paths])
    merged: list[tuple[float, ...]] = []
    original = merges.merged

    def counted(weights: tuple[float, ...]) -> dict[str, torch.Tensor]:
        merged.append(tuple(weights))
        return original(weights)

    monkeypatch.setattr(merges, "merged", counted)
    one_hot = (1.0, 0.0, 0.0)
    alone = evaluate((merges.spec, load_model_dir(paths[0]).weights), data.test)["accuracy"]
    assert merges.accuracy(one_hot, data.test) == alone  # weight 1 copies the candidate
    merges.accuracy((1.0 - 1e-15, 1e-15, 0.0), data.test)
    merges.accuracy(one_hot, data.validation)
    assert merged == [one_hot, one_hot]
