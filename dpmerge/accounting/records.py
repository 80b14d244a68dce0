"""Mechanism records and privacy labels: the *description* of a candidate (SPEC §2).

A record describes what ran; it never holds an ε. Accountants (``curves``, ``rs``, ``lc``)
analyse records, the way dp_accounting separates ``DpEvent`` values from accountants.

Records are frozen and hashable so the accountants can cache per-candidate curves on them.
Validation names the offending field. There are no silent defaults for fields that the
privacy analysis depends on: an assumed independence or sampling scheme would understate ε.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from dp_accounting import dp_event
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dpmerge.documents import describe_validation_error, read_item_list
from dpmerge.errors import RecordError

NEIGHBOURING_ADD_OR_REMOVE = "add_or_remove_one"
SAMPLING_POISSON = "poisson"


class Optimizer(StrEnum):
    """Update rule of a DP-SGD run. Only ``sgd`` (no momentum, no weight decay) makes the
    update linear in the noisy gradient sum, which the structured LC bound needs (SPEC §5.2)."""

    SGD = "sgd"
    SGD_MOMENTUM = "sgd_momentum"
    ADAM = "adam"
    ADAMW = "adamw"
    RMSPROP = "rmsprop"
    ADAGRAD = "adagrad"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", str_strip_whitespace=True)


class MechanismRecord(_Frozen):
    """What a DP-SGD candidate's training actually ran (SPEC §2).

    The analysed mechanism is the ``steps``-fold composition of the Poisson-subsampled
    Gaussian with rate ``sample_rate`` and noise multiplier ``noise_multiplier`` under
    add-or-remove-one adjacency.
    """

    kind: Literal["dpsgd"] = "dpsgd"
    name: str = Field(min_length=1)
    noise_multiplier: float = Field(gt=0, allow_inf_nan=False)
    sample_rate: float = Field(gt=0, le=1, allow_inf_nan=False)
    steps: int = Field(gt=0)
    clip_norm: float = Field(gt=0, allow_inf_nan=False)
    learning_rate: float = Field(gt=0, allow_inf_nan=False)
    expected_batch_size: float = Field(gt=0, allow_inf_nan=False)
    optimizer: Optimizer
    noise_lineage: str = Field(min_length=1)
    batch_lineage: str = Field(min_length=1)
    dataset: str = Field(min_length=1)
    neighbouring: str
    sampling: str
    dataset_size: int | None = Field(default=None, gt=0)
    initialisation: str | None = None

    @field_validator("neighbouring")
    @classmethod
    def _only_add_or_remove(cls, value: str) -> str:
        if value != NEIGHBOURING_ADD_OR_REMOVE:
            raise ValueError(
                f"only {NEIGHBOURING_ADD_OR_REMOVE!r} is supported (got {value!r}); "
                "replace-one DP-SGD needs twice the sensitivity and is not analysed here"
            )
        return value

    @field_validator("sampling")
    @classmethod
    def _only_poisson(cls, value: str) -> str:
        if value != SAMPLING_POISSON:
            raise ValueError(
                f"only {SAMPLING_POISSON!r} sampling has a claimed amplification (got {value!r}); "
                "shuffled or fixed-size batches are not Poisson"
            )
        return value

    def dp_event(self) -> dp_event.DpEvent:
        """The dp_accounting event this record describes."""
        return dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(
                self.sample_rate, dp_event.GaussianDpEvent(self.noise_multiplier)
            ),
            self.steps,
        )

    @property
    def contribution_scale(self) -> float:
        """η·C/B: the scale of one record's clipped gradient in an update (SPEC §5.2 c_i/λ_i)."""
        return self.learning_rate * self.clip_norm / self.expected_batch_size

    def is_checkpoint_of_same_run(self, other: MechanismRecord) -> bool:
        """True when both records can be checkpoints of one run: same noise and batch streams,
        same hyper-parameters, same data and initialisation; only the step count differs."""
        return all(
            getattr(self, f) == getattr(other, f)
            for f in (
                "noise_lineage",
                "batch_lineage",
                "noise_multiplier",
                "sample_rate",
                "clip_norm",
                "learning_rate",
                "expected_batch_size",
                "optimizer",
                "dataset",
                "initialisation",
            )
        )


class PrivacyLabel(_Frozen):
    """A candidate known only by its guarantee (SPEC §2): an (ε, δ) pair or an RDP curve.

    Used for vendors' models or old runs whose training is unknown. RS accepts it; LC over it
    can use only the generic bound.
    """

    kind: Literal["label"] = "label"
    name: str = Field(min_length=1)
    dataset: str = Field(min_length=1)
    epsilon: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    delta: float | None = Field(default=None, ge=0, lt=1, allow_inf_nan=False)
    rdp_orders: tuple[float, ...] | None = None
    rdp_epsilons: tuple[float, ...] | None = None
    neighbouring: str = NEIGHBOURING_ADD_OR_REMOVE

    @field_validator("neighbouring")
    @classmethod
    def _only_add_or_remove(cls, value: str) -> str:
        return MechanismRecord._only_add_or_remove(value)

    @model_validator(mode="after")
    def _one_guarantee(self) -> PrivacyLabel:
        has_pair = self.epsilon is not None or self.delta is not None
        has_rdp = self.rdp_orders is not None or self.rdp_epsilons is not None
        if has_pair == has_rdp:
            raise ValueError(
                "a privacy label holds exactly one guarantee: 'epsilon' and 'delta', "
                "or 'rdp_orders' and 'rdp_epsilons'"
            )
        if has_pair and (self.epsilon is None or self.delta is None):
            missing = "delta" if self.delta is None else "epsilon"
            raise ValueError(f"field {missing!r} is required with an (ε, δ) label")
        if has_rdp:
            orders, values = self.rdp_orders, self.rdp_epsilons
            if orders is None or values is None or len(orders) != len(values) or not orders:
                raise ValueError("'rdp_orders' and 'rdp_epsilons' must be non-empty, same length")
            if any(a <= 1 for a in orders) or any(v < 0 for v in values):
                raise ValueError("RDP orders must be > 1 and RDP values >= 0")
        return self

    @property
    def has_rdp(self) -> bool:
        return self.rdp_orders is not None


Candidate = MechanismRecord | PrivacyLabel

_RECORD_FIELDS = tuple(f for f in MechanismRecord.model_fields if f != "kind")


def candidate_from_dict(data: Mapping[str, Any]) -> Candidate:
    """Parse one candidate: a DP-SGD record if it has ``noise_multiplier``, else a label."""
    if not isinstance(data, Mapping):
        raise RecordError(f"a candidate must be a JSON object, got {type(data).__name__}")
    name = str(data.get("name", "<unnamed>"))
    is_record = "noise_multiplier" in data or data.get("kind") == "dpsgd"
    is_label = not is_record and (
        "epsilon" in data or "rdp_orders" in data or data.get("kind") == "label"
    )
    if not is_record and not is_label:
        raise RecordError(
            f"candidate {name!r}: neither a DP-SGD record (needs {', '.join(_RECORD_FIELDS)}) "
            "nor a privacy label (needs name, epsilon, delta, dataset)"
        )
    model = MechanismRecord if is_record else PrivacyLabel
    try:
        return model.model_validate(dict(data))
    except ValidationError as error:
        raise RecordError(describe_validation_error(f"candidate {name!r}", error)) from None


def candidates_from_dicts(items: Iterable[Mapping[str, Any]]) -> tuple[Candidate, ...]:
    candidates = tuple(candidate_from_dict(item) for item in items)
    names = [c.name for c in candidates]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise RecordError(f"candidate names must be unique; repeated: {', '.join(duplicates)}")
    return candidates


def load_candidates(path: str | Path) -> tuple[Candidate, ...]:
    """Read a candidates file: ``{"candidates": [{...}, ...]}`` (the CLI's format)."""
    return candidates_from_dicts(
        read_item_list(path, "candidates", what="candidates", parse=json.loads)
    )


def candidates_to_document(candidates: Sequence[Candidate]) -> dict[str, Any]:
    """The inverse of :func:`load_candidates` (JSON-ready)."""
    return {"candidates": [c.model_dump(mode="json", exclude_none=True) for c in candidates]}


def require_same_dataset(candidates: Sequence[Candidate]) -> str:
    """All candidates must come from one dataset (SPEC §2); returns its fingerprint."""
    datasets = sorted({c.dataset for c in candidates})
    if len(datasets) != 1:
        raise RecordError(
            "candidates come from different datasets "
            f"({', '.join(datasets)}); merging across datasets is not analysed"
        )
    return datasets[0]
