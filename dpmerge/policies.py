"""Privacy policies: the target a deployed model must meet, as validated data.

A policy names a dataset and model family, a target (ε*, δ*), how to merge (``auto``
calibrates RS and LC and keeps the release with the smaller noise proxy, a data-independent
choice: docs/design.md#calibration), which LC bound gates promotion (``generic``
by default, docs/design.md#generic-bound; ``structured`` is the paper's analysis, opt-in,
docs/design.md#structured-bound), the accuracy
floor, the registry alias it owns, and what happens when no release meets it (``revoke`` the
alias by default: a model that violates the current policy is not left serving).

Validation is strict: a bad policy is rejected with a message naming the field, and nothing is
changed (no event, no run).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from dpmerge.accounting.private_selection import SELECTION_EPSILON
from dpmerge.documents import describe_validation_error, load_yaml, read_item_list, shorten
from dpmerge.errors import InputError
from dpmerge.publication import dataset_name
from dpmerge.registry.tags import ALIAS_LIMIT
from dpmerge.vocabulary import GatingBound, OnNoncompliant, PolicyMethod, Tuning

if TYPE_CHECKING:
    from dpmerge.registry.catalog import Inventory

NAME = r"[a-z0-9][a-z0-9_-]{0,62}"
"""A policy name (its alias defaults to policy-<name>; keys in the state store carry it)."""
_ALIAS = re.compile(r"^[A-Za-z0-9_-]+$")  # MLflow's alias characters (ASCII only here)
_VERSION_ALIAS = re.compile(r"^[vV]\d+$")  # MLflow reserves these for versions
EVALUATION_EPSILON = 1.0
"""The default ε of the test-accuracy estimate. The test rows are people apart from the training
rows, so this ε is theirs alone; at 1 the Laplace noise's standard deviation √2/(n_test·ε) is
0.00014 on 10,000 test rows and 0.004 on the 360 digits test rows, below the sampling error of
an accuracy measured on those rows (√(p(1−p)/n_test): 0.003 and 0.016 at p = 0.9), so the
estimate costs the gate little (docs/design.md#row-protection)."""


class PolicyError(InputError):
    """A policy is malformed; the message names the field, and ``field`` (where known) says
    which, e.g. ``target_delta``."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class Policy(BaseModel):
    """One privacy policy (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid", str_strip_whitespace=True)

    name: StrictStr = Field(description="policy name (its alias is policy-<name>)")
    target_epsilon: StrictFloat = Field(
        gt=0, le=1000, allow_inf_nan=False, description="target ε* of the release"
    )
    target_delta: StrictFloat = Field(
        gt=0, lt=1, allow_inf_nan=False, description="target δ* of the release"
    )
    dataset: StrictStr = Field(
        min_length=1,
        max_length=256,
        description="dataset name (e.g. fashion-mnist) or full fingerprint of the candidates",
    )
    model: StrictStr = Field(
        min_length=1, max_length=256, description="model family of the candidates (e.g. logreg)"
    )
    data_root: StrictStr | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="where the merge reads the candidates' held-out rows: a dataset's folder, or "
        "your data's spec or file as in training (default: $DPMERGE_DATA_ROOT, else the "
        "dataset's own place); the rows read must have the candidates' fingerprint",
    )
    method: PolicyMethod = Field(
        default=PolicyMethod.AUTO,
        description="merge method (auto: RS, LC or the mixture, chosen per target from the "
        "records alone)",
    )
    gating_bound: GatingBound = Field(
        default=GatingBound.GENERIC, description="the LC bound that gates promotion"
    )
    tune_weights: StrictBool = Field(
        default=False,
        description="the unprotected opt-out: tune LC weights within the chosen subset on "
        "validation accuracy (generic gate only); the card then states that the validation "
        "rows are not protected",
    )
    tune: Tuning = Field(
        default=Tuning.NONE,
        description="private: choose among auto's release and a grid of LC weights by a "
        "differentially private selection on validation accuracy (docs/design.md#private-tuning)",
    )
    selection_epsilon: StrictFloat = Field(
        default=SELECTION_EPSILON,
        gt=0,
        le=1000,
        allow_inf_nan=False,
        description="ε of the private selection under tune: private, spent on the validation "
        "rows once per release",
    )
    min_accuracy: StrictFloat = Field(
        default=0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="floor on the released model's published test accuracy, a DP estimate",
    )
    evaluation_epsilon: StrictFloat = Field(
        default=EVALUATION_EPSILON,
        gt=0,
        le=1000,
        allow_inf_nan=False,
        description="ε of the Laplace estimate of the test accuracy, spent on the test rows "
        "once per release (docs/design.md#row-protection)",
    )
    alias: StrictStr | None = Field(
        default=None, description="registry alias the policy moves (default policy-<name>)"
    )
    on_noncompliant: OnNoncompliant = Field(
        default=OnNoncompliant.REVOKE,
        description="what happens to the alias when no release meets the policy (revoke: "
        "serve nothing; keep: keep the old model, flagged non-compliant)",
    )
    cumulative_epsilon_cap: StrictFloat | None = Field(
        default=None,
        gt=0,
        le=1000,
        allow_inf_nan=False,
        description="release-ledger cap on the cumulative ε and on one person's ε (training, "
        "test and validation rows composed; docs/design.md#release-ledger)",
    )

    @field_validator("name")
    @classmethod
    def _slug(cls, value: str) -> str:
        if not re.fullmatch(NAME, value):
            raise ValueError(
                "must be 1–63 characters of lower-case letters, digits, '-' or '_', starting "
                "with a letter or digit"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Policy:
        alias = self.alias or f"policy-{self.name}"
        if len(alias) > ALIAS_LIMIT:
            raise ValueError(
                f"alias {shorten(alias)} is {len(alias)} characters long; the registry takes at "
                f"most {ALIAS_LIMIT}"
            )
        if not _ALIAS.match(alias) or alias.lower() == "latest" or _VERSION_ALIAS.match(alias):
            raise ValueError(
                f"alias {shorten(alias)} is not a valid registry alias (letters, digits, '-', '_'; "
                "not 'latest' in any case, nor a version like 'v3')"
            )
        if self.gating_bound == "structured" and self.method in ("rs", "mixture"):
            raise ValueError(
                f"gating_bound 'structured' applies to LC; method {self.method.value!r} is "
                "gated by its mixture bound"
            )
        if self.tune_weights and self.gating_bound == "structured":
            raise ValueError(
                "tune_weights needs the generic gate: the structured bound assumes weights "
                "chosen independently of the data"
            )
        if self.tune_weights and self.method == "rs":
            raise ValueError("tune_weights applies to LC weights; method 'rs' has none")
        if self.tune == Tuning.PRIVATE and (
            self.tune_weights or self.method != "auto" or self.gating_bound != "generic"
        ):
            raise ValueError(
                "tune 'private' chooses among auto's release and LC weights under the generic "
                "gate: it needs method 'auto', gating_bound 'generic' and no tune_weights"
            )
        object.__setattr__(self, "alias", alias)
        return self

    @property
    def resource_id(self) -> str:
        """Prefect event resource id of this policy (``for_each`` key of the trigger)."""
        return f"dpmerge.policy.{self.name}"

    def event_payload(self) -> dict[str, Any]:
        """Every field, so the trigger's templates never meet a missing key (a missing key
        makes Prefect silently create no run)."""
        return self.model_dump(mode="json")


def check_registered(policies: Iterable[Policy], inventory: Inventory) -> None:
    """Each policy's model family and dataset must have ready candidates in ``inventory`` (the
    registry it targets): otherwise :class:`PolicyError` naming the field and the choices, before
    any event is sent or any run starts."""
    for policy in policies:
        where = f"policy {policy.name!r}: field"
        models = inventory.models
        if policy.model not in models:
            raise PolicyError(
                f"{where} 'model': no ready candidates of {shorten(policy.model)} at "
                f"{inventory.tracking_uri}; choose one of: {_choices(models)}"
            )
        # registered datasets carry the keyed identifier (name-hmac:…); a policy names the
        # dataset, or one identifier or fingerprint of it (checked exactly by the workflow)
        identifiers = [d for d, m in inventory.counts if m == policy.model]
        names = sorted({dataset_name(d) for d in identifiers})
        if dataset_name(policy.dataset) not in names:
            raise PolicyError(
                f"{where} 'dataset': no ready {policy.model} candidates on "
                f"{shorten(policy.dataset)} at {inventory.tracking_uri}; choose one of: "
                f"{_choices(names)}"
            )


def check_delta_known(policies: Iterable[Policy], inventory: Inventory) -> None:
    """Each policy's δ* against the smallest n the ready candidates of its dataset and model
    state (:class:`PolicyError` naming ``target_delta`` when δ* ≥ 1/n; the smallest n, on the
    safe side): what its run would refuse is refused before anything is stored."""
    from dpmerge.accounting.delta import DeltaError, check_delta_against

    for policy in policies:
        sizes = [
            n
            for (dataset, model), n in inventory.sizes.items()
            if model == policy.model and dataset_name(dataset) == dataset_name(policy.dataset)
        ]
        if sizes:
            try:
                check_delta_against(policy.target_delta, min(sizes))
            except DeltaError as error:
                raise PolicyError(
                    f"policy {policy.name!r}: field 'target_delta': {error}", "target_delta"
                ) from None


def _choices(values: Iterable[str]) -> str:
    listed = [repr(v) for v in values]
    return ", ".join(listed) if listed else "none (train candidates first)"


def policy_from_dict(data: Mapping[str, Any]) -> Policy:
    if not isinstance(data, Mapping):
        raise PolicyError(f"a policy must be a mapping, got {type(data).__name__}")
    where = f"policy {shorten(data.get('name', '<unnamed>'))}"
    try:
        return Policy.model_validate(dict(data))
    except ValidationError as error:
        loc = error.errors()[0]["loc"] if error.errors() else ()
        field = ".".join(str(p) for p in loc) or "policy"
        raise PolicyError(describe_validation_error(where, error, Policy), field) from None


REQUIRED_PLACEHOLDERS = {
    "target_epsilon": 1.0,
    "target_delta": 1e-5,
    "dataset": "placeholder",
    "model": "placeholder",
}
"""Valid values for the required fields, so that :func:`check_fields` judges the given ones."""


def check_fields(fields: Mapping[str, Any]) -> None:
    """The fields of a partial change, validated on their own before anything is read (a bad
    alias or a typo is refused before the registry or the store is located): every error names
    a given field, since the placeholders of the others are valid."""
    policy_from_dict({**REQUIRED_PLACEHOLDERS, **fields})


def policies_from_dicts(items: Iterable[Mapping[str, Any]]) -> tuple[Policy, ...]:
    policies = tuple(policy_from_dict(item) for item in items)
    for attribute in ("name", "alias"):
        values = [getattr(p, attribute) for p in policies]
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise PolicyError(
                f"policy {attribute}s must be unique; repeated: {', '.join(repeated)}"
            )
    return policies


def load_policies(path: str | Path) -> tuple[Policy, ...]:
    """Read ``{"policies": [...]}`` from a YAML file; every policy is validated first."""
    return policies_from_dicts(
        read_item_list(path, "policies", what="policy", parse=load_yaml, error=PolicyError)
    )
