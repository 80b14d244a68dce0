"""δ, checked: a number in (0, 1), and below 1/n for the n training rows it protects
(docs/design.md#mechanism-record).

(ε, δ)-DP allows the guarantee to fail with probability δ. The mechanism that publishes one
uniformly chosen training row in the clear is (0, 1/n)-DP, so a δ of 1/n or more permits
exactly that: it is refused, naming n. Common practice asks for δ well below 1/n; above
1/(10·n) the check passes with a warning (:attr:`DeltaCheck.warning`), which commands print and
the privacy card can carry. n is the records' ``dataset_size``; where no record carries one
(a privacy label, an older candidates file), δ is checked for range only and
:attr:`DeltaCheck.note` says so; ``dpmerge account`` and ``merge`` take n from
``--dataset-size`` then, and ``merge`` refuses without one (:func:`delta_check_for`).

Every entry point that takes a δ for training, merging, accounting or a policy calls
:func:`check_delta` (the number) and :func:`delta_check_for` or :func:`check_delta_against`
(against n) before it computes anything.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dpmerge.errors import InputError, RecordError

WARN_FACTOR = 10
"""δ above 1/(WARN_FACTOR·n) is accepted with a warning."""


class DeltaError(InputError):
    """δ is not below 1/n: a guarantee that weak permits releasing a training row in the clear."""


def check_delta(delta: float) -> float:
    """``delta`` as a float in (0, 1); :class:`RecordError` for anything else (a boolean or a
    string is not a number)."""
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real):
        raise RecordError(f"δ must be a number, got {type(delta).__name__}")
    if not (math.isfinite(delta) and 0 < delta < 1):
        raise RecordError(f"δ must lie in (0, 1), got {delta}")
    return float(delta)


@dataclass(frozen=True)
class DeltaCheck:
    """A δ that passed :func:`check_delta_against`, with the n it was checked against
    (``None``: no record carries a dataset size)."""

    delta: float
    dataset_size: int | None

    @property
    def warning(self) -> str | None:
        """``warning: …`` when δ exceeds 1/(10·n), else ``None``."""
        n = self.dataset_size
        if n is None or self.delta <= 1 / (WARN_FACTOR * n):
            return None
        return (
            f"warning: δ = {self.delta:g} is above 1/({WARN_FACTOR}·n) = "
            f"{1 / (WARN_FACTOR * n):.3g} for n = {n:,} training rows: a weak guarantee "
            f"(δ < 1/n = {1 / n:.3g} is the least a release needs; δ ≤ "
            f"{1 / (WARN_FACTOR * n):.3g} is usual)"
        )

    @property
    def note(self) -> str | None:
        """Why δ was not checked against n, when it was not."""
        if self.dataset_size is not None:
            return None
        return (
            f"δ = {self.delta:g} was not checked against the dataset size: no candidate record "
            "carries dataset_size"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "delta": self.delta,
            "dataset_size": self.dataset_size,
            "warning": self.warning,
            "note": self.note,
        }


def check_delta_against(delta: float, dataset_size: int | None) -> DeltaCheck:
    """``delta`` checked for range and against ``dataset_size`` n: :class:`DeltaError` naming n
    when δ ≥ 1/n."""
    delta = check_delta(delta)
    if dataset_size is not None and delta * dataset_size >= 1:
        raise DeltaError(
            f"δ = {delta:g} is not below 1/n = {1 / dataset_size:.3g} for n = {dataset_size:,} "
            "training rows: a guarantee with δ ≥ 1/n permits releasing a training row in the "
            f"clear; choose δ < {1 / dataset_size:.3g} (usually ≤ "
            f"{1 / (WARN_FACTOR * dataset_size):.3g})"
        )
    return DeltaCheck(delta, dataset_size)


def delta_check_for(
    records: Iterable[Any],
    delta: float,
    dataset_size: int | None = None,
    *,
    required: bool = False,
) -> DeltaCheck:
    """``delta`` checked against the smallest ``dataset_size`` of ``records`` (mechanism
    records; labels and records without one carry no n) and against a given ``dataset_size``:
    δ must pass both, and the larger n is the stricter check, so a given n never loosens the
    records'. ``required``: a :class:`DeltaError` when neither gives n (a release is not made
    on an unchecked δ)."""
    if dataset_size is not None and (
        isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or dataset_size < 1
    ):
        raise RecordError(f"the dataset size must be a positive integer, got {dataset_size!r}")
    sizes = [s for s in (getattr(r, "dataset_size", None) for r in records) if s is not None]
    recorded = min(sizes) if sizes else None
    if required and recorded is None and dataset_size is None:
        raise DeltaError(
            f"δ = {check_delta(delta):g} cannot be checked against the dataset size: no "
            "candidate record carries dataset_size; give --dataset-size n (the number of "
            "training rows)"
        )
    given = [n for n in (recorded, dataset_size) if n is not None]
    return check_delta_against(delta, max(given) if given else None)
