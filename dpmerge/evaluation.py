"""Evaluating a model on a held-out split, the accuracy of LC merges as they are released, and
the expected accuracy of RS (docs/design.md#calibration, docs/design.md#studies).

Reported figures are measured on the test split by default; the validation split (carved from
the training file, disjoint from the training rows) serves calibration utilities
(docs/design.md#random-selection).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from dpmerge.accounting.weights import simplex_weights
from dpmerge.artifacts import ModelSpec
from dpmerge.data import Split
from dpmerge.errors import DatasetError, RecordError
from dpmerge.merging import linear_combination
from dpmerge.models import build_model, check_weights_match

ModelLike = nn.Module | tuple[ModelSpec, Mapping[str, torch.Tensor]]


def _as_module(model: ModelLike) -> nn.Module:
    """The module itself, or ``spec``'s module loaded with ``state_dict`` (checked first)."""
    if isinstance(model, nn.Module):
        return model
    spec, state_dict = model
    check_weights_match(spec, state_dict)
    module = build_model(spec)
    module.load_state_dict(state_dict, strict=True)
    return module


def evaluate(
    model: ModelLike,
    split: Split,
    *,
    batch_size: int = 1024,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Accuracy, mean cross-entropy loss, per-class accuracy and n of ``model`` on ``split``.

    ``per_class_accuracy[c]`` is ``None`` for a class with no example in the split. The module
    is run in eval mode without gradients and its training mode is restored afterwards.
    """
    if len(split) == 0:
        raise DatasetError("cannot evaluate on an empty split")
    if batch_size < 1:
        raise RecordError(f"batch size must be positive, got {batch_size}")
    if not isinstance(model, nn.Module):
        spec = model[0]
        if tuple(split.features.shape[1:]) != spec.input_shape:
            raise DatasetError(
                f"the data has input shape {tuple(split.features.shape[1:])}, "
                f"the model expects {spec.input_shape}"
            )
    module = _as_module(model)
    was_training = module.training
    module.to(device).eval()
    loss_total, predictions, num_classes = 0.0, [], 0
    try:
        with torch.inference_mode():
            for start in range(0, len(split), batch_size):
                logits = module(split.features[start : start + batch_size].to(device)).float()
                labels = split.labels[start : start + batch_size].to(device)
                num_classes = logits.shape[1]
                if int(labels.max()) >= num_classes or int(labels.min()) < 0:
                    raise DatasetError(
                        f"labels outside 0..{num_classes - 1} for a {num_classes}-class model"
                    )
                loss_total += float(functional.cross_entropy(logits, labels, reduction="sum"))
                predictions.append(logits.argmax(dim=1).cpu())
    finally:
        module.train(was_training)
    labels = split.labels.cpu()
    hits = torch.cat(predictions) == labels
    correct = torch.bincount(labels[hits], minlength=num_classes).tolist()
    counts = torch.bincount(labels, minlength=num_classes).tolist()
    n = len(split)
    return {
        "n": n,
        "accuracy": int(hits.sum()) / n,
        "loss": loss_total / n,
        "per_class_accuracy": [c / t if t else None for c, t in zip(correct, counts, strict=True)],
    }


class MergeAccuracy:
    """Accuracy of λ-weighted LC merges of candidates' weights files, each merge computed by
    :func:`~dpmerge.merging.linear_combination`, the arithmetic of the released merge (streamed,
    accumulated in float32, cast back), so a calibration's utility is the accuracy of the model
    it releases, bit for bit (docs/design.md#calibration). Cached by λ (to 12 digits) and split.
    """

    def __init__(
        self,
        spec: ModelSpec,
        files: Sequence[str | Path],
        *,
        batch_size: int = 1024,
        device: str | torch.device = "cpu",
    ) -> None:
        self.spec, self.files = spec, [Path(f) for f in files]
        self.batch_size, self.device = batch_size, device
        self._splits: dict[int, Split] = {}  # held, so that an id is never reused
        self._cache: dict[tuple[tuple[float, ...], int], float] = {}

    def merged(self, weights: Sequence[float]) -> dict[str, torch.Tensor]:
        """Σ λ_i θ_i exactly as ``merge_model_dirs`` releases it on this device."""
        return linear_combination(self.files, weights, device=self.device)

    def accuracy(self, weights: Sequence[float], split: Split) -> float:
        """Accuracy on ``split`` of the merge with weights λ."""
        key = (tuple(round(float(w), 12) for w in weights), id(split))
        if key not in self._cache:
            self._splits[id(split)] = split
            scores = evaluate(
                (self.spec, self.merged(weights)),
                split,
                batch_size=self.batch_size,
                device=self.device,
            )
            self._cache[key] = float(scores["accuracy"])
        return self._cache[key]


def expected_accuracy(accuracies: Sequence[float], probabilities: Sequence[float]) -> float:
    """Σ π_i·acc_i: the expected accuracy of RS with probabilities π
    (docs/design.md#random-selection objective).

    This is a statistic of every candidate, released or not, so it belongs in internal reports
    and audit records, not in the released model's public metrics.
    """
    pi = simplex_weights(probabilities, len(accuracies), what="RS probabilities")
    return sum(p * float(a) for p, a in zip(pi, accuracies, strict=True))
