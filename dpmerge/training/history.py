"""The per-epoch history of a run: training loss, held-out accuracy and loss, training time.

Each entry is measured when an epoch's last step has run (and once more when a run stops
mid-epoch); the held-out splits are scored with :func:`dpmerge.evaluation.evaluate`, outside
the training clock. ``train_loss`` is the mean loss of the epoch's non-empty batches: a
statistic of the private training rows without noise, so it stays in memory
(:attr:`TrainResult.history`) and is left out of the model directory (:meth:`public`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from dpmerge.data import DatasetSplits, Split
from dpmerge.evaluation import evaluate

HELD_OUT = ("validation", "test")


@dataclass(frozen=True)
class EpochMetrics:
    """One epoch of a run (1-based; a run stopped early ends with a partial epoch)."""

    epoch: int
    step: int
    """Steps run at the epoch's end (cumulative)."""
    train_loss: float | None
    """Mean loss of the epoch's non-empty batches (``None`` if all were empty)."""
    validation_accuracy: float | None
    validation_loss: float | None
    test_accuracy: float | None
    test_loss: float | None
    train_seconds: float
    """Wall time of training so far, evaluations excluded (cumulative)."""

    def public(self) -> dict[str, Any]:
        """The entry without training-set statistics, as ``metrics.json`` holds it."""
        return {k: v for k, v in asdict(self).items() if k != "train_loss"}


def score_held_out(
    model: nn.Module, data: DatasetSplits, device: torch.device
) -> dict[str, float | None]:
    """``<split>_accuracy`` and ``<split>_loss`` of ``model`` on the held-out splits (``None``
    for an empty split)."""
    scores: dict[str, float | None] = {}
    for name in HELD_OUT:
        split: Split = getattr(data, name)
        result = evaluate(model, split, device=device) if len(split) else {}
        scores[f"{name}_accuracy"] = result.get("accuracy")
        scores[f"{name}_loss"] = result.get("loss")
    return scores
