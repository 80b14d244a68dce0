"""Settings the model studies share, validated before any work starts (docs/design.md#studies)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from dpmerge.errors import DPMergeError

MODEL_ALIASES = {"resnet18-gn": "resnet18_gn"}
"""Command-line spellings of model names (``dpmerge.models`` names them with underscores)."""


class StudyConfigError(DPMergeError, ValueError):
    """A study setting that cannot run (the message names it)."""


def check_targets(targets: Sequence[float]) -> None:
    if not targets or any(not (math.isfinite(t) and t > 0) for t in targets):
        raise StudyConfigError(f"targets must be positive numbers, got {list(targets)}")


@dataclass(frozen=True)
class CandidateStudy:
    """Data, model and DP-SGD settings of a study that trains candidates, and its targets:
    ``targets`` if given, else a grid of ``grid`` targets between the candidates' ε."""

    dataset: str = "fashion-mnist"
    data_root: str | None = None
    limit: int | None = None
    model: str = "cnn"
    device: str = "cpu"
    sigmas: tuple[float, ...] = (0.8, 1.2, 2.0)
    grid: int = 4
    targets: tuple[float, ...] | None = None
    seeds: int = 1
    epochs: int = 1
    batch_size: int = 256
    learning_rate: float | None = None
    clip_norm: float = 1.0
    delta: float = 1e-5
    max_steps: int | None = None
    structured: bool = True

    COUNTS: ClassVar[tuple[str, ...]] = ("grid", "seeds", "epochs", "batch_size")

    def __post_init__(self) -> None:
        if len(self.sigmas) < 2 or any(not (math.isfinite(s) and s > 0) for s in self.sigmas):
            raise StudyConfigError(f"give at least two positive σ values, got {self.sigmas}")
        for name in self.COUNTS:
            if getattr(self, name) < 1:
                raise StudyConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.targets is not None:
            check_targets(self.targets)
        elif self.grid < 2:
            raise StudyConfigError(
                f"grid must be at least 2 (it runs from the most to the least private "
                f"candidate's ε), got {self.grid}; give --targets for a single target"
            )

    @property
    def model_name(self) -> str:
        return MODEL_ALIASES.get(self.model, self.model)

    @property
    def points(self) -> int:
        """How many targets the study evaluates."""
        return len(self.targets) if self.targets else self.grid
