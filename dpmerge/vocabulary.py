"""The closed vocabularies of dpmerge, in one place (docs/design.md#mechanism-record).

Each is a ``StrEnum``: members compare equal to their string values, so documents, tags and
CLI options carry plain strings while the code names the members.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

from dpmerge.documents import shorten
from dpmerge.errors import InputError

E = TypeVar("E", bound=StrEnum)


def choose(enum: type[E], value: object, what: str) -> E:
    """``enum(value)``, or ``InputError`` naming ``what`` and the valid choices."""
    if isinstance(value, enum):
        return value
    if isinstance(value, str):
        try:
            return enum(value)
        except ValueError:
            pass
    choices = ", ".join(repr(m.value) for m in enum)
    raise InputError(f"{what} must be one of {choices}, got {shorten(value)}")


class Neighbouring(StrEnum):
    """Neighbouring relation of a guarantee. Only add-or-remove-one is analysed: replace-one
    DP-SGD needs twice the sensitivity (docs/design.md#mechanism-record)."""

    ADD_OR_REMOVE_ONE = "add_or_remove_one"


class Sampling(StrEnum):
    """Batch sampling scheme of a DP-SGD run. Only Poisson sampling has a claimed
    amplification; shuffled or fixed-size batches are not Poisson (docs/design.md#sharp-edges)."""

    POISSON = "poisson"


class Optimizer(StrEnum):
    """Update rule of a DP-SGD run. Only ``sgd`` (no momentum, no weight decay) makes the
    update linear in the noisy gradient sum, which the structured LC bound needs
    (docs/design.md#structured-bound)."""

    SGD = "sgd"
    SGD_MOMENTUM = "sgd_momentum"
    ADAM = "adam"
    ADAMW = "adamw"
    RMSPROP = "rmsprop"
    ADAGRAD = "adagrad"


class Method(StrEnum):
    """How candidates are merged: random selection or linear combination."""

    RS = "rs"
    LC = "lc"


class GatingBound(StrEnum):
    """Which LC bound gates a release: ``generic`` (composition over release units, no
    assumption; the default) or ``structured`` (the DP model merging paper's analysis, opt-in)."""

    GENERIC = "generic"
    STRUCTURED = "structured"


class PolicyMethod(StrEnum):
    """A policy's merge method: ``auto`` calibrates RS and LC and keeps the better one."""

    AUTO = "auto"
    RS = "rs"
    LC = "lc"


class OnInfeasible(StrEnum):
    """What a policy does with its alias when its target is infeasible (docs/design.md#policies):
    ``revoke`` (default: a model that violates the current policy is not left serving) or
    ``keep``."""

    REVOKE = "revoke"
    KEEP = "keep"


class BoundKind(StrEnum):
    """The analysis behind a reported ε."""

    CANDIDATE = "candidate"
    SELECTION = "selection"
    GENERIC = "generic"
    STRUCTURED = "structured"
    GAUSSIAN = "gaussian"


class Accountant(StrEnum):
    """The accountant that produced an ε."""

    PLD = "pld"
    RDP = "rdp"


class UnitKind(StrEnum):
    """What a release unit of the generic bound is (docs/design.md#release-units)."""

    RUN = "run"
    """One DP-SGD run (checkpoints of it collapsed to the longest)."""
    SHARED_BATCHES = "shared_batches"
    """Runs that drew identical Poisson batches with independent noise."""
    LABEL = "label"
    """A candidate known only by its privacy label."""


class DatasetName(StrEnum):
    """The datasets :func:`dpmerge.data.load_dataset` reads (docs/training.md, "Data")."""

    DIGITS = "digits"
    FASHION_MNIST = "fashion-mnist"
    MNIST = "mnist"
    CIFAR10 = "cifar10"


class ModelName(StrEnum):
    """The architectures :mod:`dpmerge.models` builds and a record's ``model.json`` names."""

    LOGREG = "logreg"
    CNN = "cnn"
    RESNET18_GN = "resnet18_gn"


class GradSampleMode(StrEnum):
    """How per-example gradients are computed: the exact linear engine, or an Opacus mode."""

    LINEAR_EXACT = "linear-exact"
    HOOKS = "hooks"
    FUNCTORCH = "functorch"
    EW = "ew"
    GHOST = "ghost"


class Engine(StrEnum):
    """The code that runs the DP-SGD mechanism (docs/training.md, "Engines")."""

    LINEAR_EXACT = "linear-exact"
    OPACUS = "opacus"


def values(vocabulary: type[StrEnum]) -> tuple[str, ...]:
    """The plain string values of ``vocabulary``, in declaration order (CLI ``choices``)."""
    return tuple(member.value for member in vocabulary)


class KeyPurpose(StrEnum):
    """What the workflow's secret key is used for; each purpose derives its own sub-key
    (domain separation, docs/design.md#security)."""

    RECORD_SIGNATURE = "record-signature/v1"
    """HMAC over a candidate's content hash: a record an artifact-store writer changed fails."""
    DATASET_ID = "dataset-id/v1"
    """The published dataset identifier: a keyed hash of the training-data fingerprint."""
    LINEAGE_ID = "lineage-id/v1"
    """Published noise and batch lineages and run ids: keyed hashes, so no seed shows."""
    KEY_ID = "key-id/v1"
    """A short public identifier of the key itself (which key signed a record)."""


class StackDatabase(StrEnum):
    """The database behind the local stack's Prefect server and MLflow backend store
    (docs/stack.md)."""

    POSTGRES = "postgres"
    SQLITE = "sqlite"


class StackRole(StrEnum):
    """Who uses the local stack, each with its own credentials
    (docs/stack.md#roles-and-permissions)."""

    WORKFLOW = "workflow"
    """The workers, the flows and the deploying admin: manage the registry, the state and audit
    buckets, the Prefect API."""
    OPERATOR = "operator"
    """Reads candidates and releases; writes policies and quarantine records only."""
    CONSUMER = "consumer"
    """Reads releases (registered models, runs, artifacts) and nothing else."""
