"""Mechanism records and privacy labels: the *description* of a candidate
(docs/design.md#mechanism-record).

A record describes what ran; it never holds an ε. Accountants (``pld``, ``rdp``, ``rs``, ``units``,
``structured``) analyse records, the way dp_accounting separates ``DpEvent`` values from
accountants.

Records are frozen and hashable so the accountants can cache per-candidate curves on them.
Every number is strictly typed (a boolean or a string is not a number, ``500.0`` is not a step
count) and bounded to the range the accountants support; validation names the offending field.
There are no silent defaults for fields that the privacy analysis depends on: an assumed
independence or sampling scheme would understate ε.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from dpmerge.documents import (
    describe_validation_error,
    load_json,
    read_item_list,
    shorten,
    unknown_key,
)
from dpmerge.errors import RecordError
from dpmerge.vocabulary import Neighbouring, Optimizer, Sampling

if TYPE_CHECKING:  # dp_accounting loads on first use: a policy or a command reads records
    from dp_accounting import dp_event

MIN_NOISE_MULTIPLIER = 0.1
"""Below this a single step already has ε in the tens, and the PLD grid at 1e-4 needs gigabytes
(σ = 0.05: 1.4 GB, σ = 0.02: 5 GB); such runs are not analysed."""
MAX_NOISE_MULTIPLIER = 1e3
MAX_STEPS = 10**9
MAX_LABEL_EPSILON = 100.0
"""A label's PLD spans ±ε on the 1e-4 grid; beyond 100 the guarantee is void anyway."""
UNKNOWN_BATCH_LINEAGE = "unknown:"
"""Prefix of the batch lineage of an imported run whose batches are unknown, followed by the
dataset fingerprint: such runs of one dataset share it, so they form one release unit
(docs/design.md#imported-candidates)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", str_strip_whitespace=True)


def _only_add_or_remove(value: Any) -> Any:
    if value != Neighbouring.ADD_OR_REMOVE_ONE:
        why = (
            "replace-one DP-SGD needs twice the sensitivity and is not analysed here"
            if "replace" in str(value).lower()
            else "the only relation analysed, spelt with underscores"
        )
        raise ValueError(
            f"only {Neighbouring.ADD_OR_REMOVE_ONE.value!r} is supported (got "
            f"{shorten(value)}): {why}"
        )
    return value


class MechanismRecord(_Frozen):
    """What a DP-SGD candidate's training actually ran (docs/design.md#mechanism-record).

    The analysed mechanism is the ``steps``-fold composition of the Poisson-subsampled
    Gaussian with rate ``sample_rate`` and noise multiplier ``noise_multiplier`` under
    add-or-remove-one adjacency. ``run_id`` names the training run: checkpoints of one run
    share it, and only records that share it are ever collapsed into one release unit.
    """

    kind: Literal["dpsgd"] = "dpsgd"
    name: StrictStr = Field(min_length=1, max_length=256)
    noise_multiplier: StrictFloat = Field(
        ge=MIN_NOISE_MULTIPLIER, le=MAX_NOISE_MULTIPLIER, allow_inf_nan=False
    )
    sample_rate: StrictFloat = Field(gt=0, le=1, allow_inf_nan=False)
    steps: StrictInt = Field(gt=0, le=MAX_STEPS)
    clip_norm: StrictFloat = Field(gt=0, allow_inf_nan=False)
    learning_rate: StrictFloat = Field(gt=0, allow_inf_nan=False)
    expected_batch_size: StrictFloat = Field(gt=0, allow_inf_nan=False)
    optimizer: Optimizer
    noise_lineage: StrictStr = Field(min_length=1)
    batch_lineage: StrictStr = Field(min_length=1)
    dataset: StrictStr = Field(min_length=1)
    neighbouring: Neighbouring
    sampling: Sampling
    dataset_size: StrictInt | None = Field(default=None, gt=0)
    initialisation: StrictStr | None = None
    run_id: StrictStr | None = Field(default=None, min_length=1)
    attested_by: StrictStr | None = Field(default=None, min_length=1, max_length=256)
    """Set on imported candidates only: who attested this record
    (docs/design.md#imported-candidates)."""

    _neighbouring = field_validator("neighbouring", mode="before")(_only_add_or_remove)

    @field_validator("sampling", mode="before")
    @classmethod
    def _only_poisson(cls, value: Any) -> Any:
        if value != Sampling.POISSON:
            raise ValueError(
                f"only {Sampling.POISSON.value!r} sampling has a claimed amplification (got "
                f"{shorten(value)}); shuffled or fixed-size batches are not Poisson"
            )
        return value

    def dp_event(self) -> dp_event.DpEvent:
        """The dp_accounting event this record describes."""
        from dp_accounting import dp_event

        return dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(
                self.sample_rate, dp_event.GaussianDpEvent(self.noise_multiplier)
            ),
            self.steps,
        )

    @property
    def contribution_scale(self) -> float:
        """η·C/B: the scale of one record's clipped gradient in an update
        (docs/design.md#structured-bound, c_i/λ_i)."""
        return self.learning_rate * self.clip_norm / self.expected_batch_size

    def same_run_except_steps(self, other: MechanismRecord) -> bool:
        """True when both records describe one run (same ``run_id``, streams, hyper-parameters,
        data and initialisation); only the step count may differ. Records without a run id
        are never the same run: equal seeds alone do not identify one."""
        if self.run_id is None or other.run_id is None:
            return False
        return all(
            getattr(self, f) == getattr(other, f)
            for f in (
                "run_id",
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
    """A candidate known only by its guarantee (docs/design.md#mechanism-record): an (ε, δ)
    pair or an RDP curve. Used for vendors' models or old runs whose training is unknown. RS
    accepts it; LC over it can use only the generic bound."""

    kind: Literal["label"] = "label"
    name: StrictStr = Field(min_length=1, max_length=256)
    dataset: StrictStr = Field(min_length=1)
    epsilon: StrictFloat | None = Field(
        default=None, ge=0, le=MAX_LABEL_EPSILON, allow_inf_nan=False
    )
    delta: StrictFloat | None = Field(default=None, ge=0, lt=1, allow_inf_nan=False)
    rdp_orders: tuple[StrictFloat, ...] | None = Field(default=None, max_length=4096)
    rdp_epsilons: tuple[StrictFloat, ...] | None = Field(default=None, max_length=4096)
    neighbouring: Neighbouring = Neighbouring.ADD_OR_REMOVE_ONE
    initialisation: StrictStr | None = Field(default=None, min_length=1, max_length=256)
    """Where training started, as an imported profile states it: LC averages a label's weights
    only with candidates that name the same start (docs/design.md#imported-candidates)."""
    attested_by: StrictStr | None = Field(default=None, min_length=1, max_length=256)
    """Set on imported candidates only: who attested this label
    (docs/design.md#imported-candidates)."""

    _neighbouring = field_validator("neighbouring", mode="before")(_only_add_or_remove)

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
            if any(not 1 < a < 1e6 for a in orders) or any(not 0 <= v < 1e6 for v in values):
                raise ValueError("RDP orders must lie in (1, 1e6) and RDP values in [0, 1e6)")
            if len(set(orders)) != len(orders):
                raise ValueError("RDP orders must be distinct")
        return self

    @property
    def has_rdp(self) -> bool:
        return self.rdp_orders is not None


Candidate = MechanismRecord | PrivacyLabel

_RECORD_FIELDS = tuple(f for f in MechanismRecord.model_fields if f not in ("kind", "attested_by"))


def candidate_from_dict(data: Mapping[str, Any]) -> Candidate:
    """Parse one candidate: a DP-SGD record if it has ``noise_multiplier``, else a label."""
    if not isinstance(data, Mapping):
        raise RecordError(f"a candidate must be a JSON object, got {type(data).__name__}")
    name = data.get("name", "<unnamed>")
    where = f"candidate {shorten(name)}"
    is_record = "noise_multiplier" in data or data.get("kind") == "dpsgd"
    is_label = not is_record and (
        "epsilon" in data or "rdp_orders" in data or data.get("kind") == "label"
    )
    if not is_record and not is_label:
        known = {*MechanismRecord.model_fields, *PrivacyLabel.model_fields}
        unknown = next((k for k in data if k not in known), None)
        hint = "" if unknown is None else f"; {unknown_key(unknown, known)}"
        raise RecordError(
            f"{where}: neither a DP-SGD record (needs {', '.join(_RECORD_FIELDS)}) "
            f"nor a privacy label (needs name, epsilon, delta, dataset){hint}"
        )
    model = MechanismRecord if is_record else PrivacyLabel
    try:
        return model.model_validate(dict(data))
    except ValidationError as error:
        raise RecordError(describe_validation_error(where, error, model)) from None


def candidates_from_dicts(items: Iterable[Mapping[str, Any]]) -> tuple[Candidate, ...]:
    """Parse every candidate; names must be unique (checked in linear time)."""
    candidates = tuple(candidate_from_dict(item) for item in items)
    counts = Counter(c.name for c in candidates)
    repeated = sorted(n for n, count in counts.items() if count > 1)
    if repeated:
        shown = ", ".join(shorten(n) for n in repeated[:5])
        more = f" and {len(repeated) - 5} more" if len(repeated) > 5 else ""
        raise RecordError(f"candidate names must be unique; repeated: {shown}{more}")
    return candidates


def load_candidates(path: str | Path) -> tuple[Candidate, ...]:
    """Read a candidates file: ``{"candidates": [{...}, ...]}`` (the CLI's format)."""
    return candidates_from_dicts(
        read_item_list(path, "candidates", what="candidates", parse=load_json)
    )


def candidates_to_document(candidates: Sequence[Candidate]) -> dict[str, Any]:
    """The inverse of :func:`load_candidates` (JSON-ready)."""
    return {"candidates": [c.model_dump(mode="json", exclude_none=True) for c in candidates]}


def require_same_dataset(candidates: Sequence[Candidate]) -> str:
    """All candidates must come from one dataset; returns its fingerprint."""
    datasets = sorted({c.dataset for c in candidates})
    if len(datasets) != 1:
        shown = ", ".join(shorten(d) for d in datasets[:5])
        raise RecordError(
            f"candidates come from different datasets ({shown}); merging across datasets is "
            "not analysed"
        )
    return datasets[0]


def attestation_lines(candidates: Iterable[Candidate]) -> tuple[str, ...]:
    """What the cards say in bold of imported candidates (docs/design.md#imported-candidates):
    each attester, and that unknown batches made such runs one release unit."""
    used = list(candidates)
    attesters = sorted({c.attested_by for c in used if c.attested_by is not None})
    lines = [f"record attested by {a}, not produced by dpmerge's training" for a in attesters]
    if any(
        isinstance(c, MechanismRecord) and c.batch_lineage.startswith(UNKNOWN_BATCH_LINEAGE)
        for c in used
    ):
        lines.append(
            "imported DP-SGD candidates of unknown batches are taken as one release unit per "
            "dataset (as if they drew the same batches)"
        )
    return tuple(lines)
