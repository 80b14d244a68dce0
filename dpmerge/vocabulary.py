"""The closed vocabularies of dpmerge, in one place (docs/design.md#mechanism-record).

Each is a ``StrEnum``: members compare equal to their string values, so documents, tags and
CLI options carry plain strings while the code names the members.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import TypeVar

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
    from dpmerge.documents import shorten  # here: the command line's parser imports this module

    choices = ", ".join(repr(m.value) for m in enum)
    raise InputError(f"{what} must be one of {choices}, got {shorten(value)}")


class Neighbouring(StrEnum):
    """Neighbouring relation of a guarantee. Only add-or-remove-one is analysed: replace-one
    DP-SGD needs twice the sensitivity (docs/design.md#mechanism-record)."""

    ADD_OR_REMOVE_ONE = "add_or_remove_one"


class EvaluationMechanism(StrEnum):
    """The mechanism that protects the test rows of a released model's published accuracy
    (docs/design.md#row-protection). Only Laplace: pure ε, δ = 0, its scale exact."""

    LAPLACE = "laplace"


class SelectionMechanism(StrEnum):
    """The mechanism that protects the validation rows under private tuning
    (docs/design.md#row-protection): the exponential mechanism on the count of correct
    validation predictions, sampled as report-noisy-max with Gumbel noise; pure ε, δ = 0."""

    EXPONENTIAL = "exponential"


class Tuning(StrEnum):
    """How a policy chooses among its feasible merges (docs/design.md#private-tuning):
    ``none`` from the records alone; ``private`` by a differentially private selection on
    validation accuracy, its ε spent on the validation rows."""

    NONE = "none"
    PRIVATE = "private"


class Composition(StrEnum):
    """How the release ledger composes a statement (docs/design.md#release-ledger):
    ``sequential`` adds the parts' ε (basic composition; exact-safe for pure ε), ``parallel``
    takes the largest (the parts are disjoint sets of people)."""

    SEQUENTIAL = "sequential"
    PARALLEL = "parallel"


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
    """How candidates are merged: random selection, linear combination, or a secret draw
    between two LC merges of subsets (docs/design.md#random-selection, "RS between merges")."""

    RS = "rs"
    LC = "lc"
    MIXTURE = "mixture"


class GatingBound(StrEnum):
    """Which LC bound gates a release: ``generic`` (composition over release units, no
    assumption; the default) or ``structured`` (the DP model merging paper's analysis, opt-in)."""

    GENERIC = "generic"
    STRUCTURED = "structured"


class PolicyMethod(StrEnum):
    """A policy's merge method: ``auto`` calibrates RS, LC and the mixture and keeps the one with
    the best expected noise proxy, a rule read off the records
    (``dpmerge.accounting.choice.choose_method``, docs/design.md#calibration)."""

    AUTO = "auto"
    RS = "rs"
    LC = "lc"
    MIXTURE = "mixture"


class OnNoncompliant(StrEnum):
    """What a policy does with its alias when a run cannot serve a release that meets the
    policy's current version and the release it serves does not meet it either — an infeasible
    target, a failed gate, the ledger cap (docs/design.md#release-state): ``revoke`` (default:
    a model that violates the current policy is not left serving) or ``keep`` (flagged
    non-compliant on the card, in ``registry ls`` and in the run's state)."""

    REVOKE = "revoke"
    KEEP = "keep"


class ServingState(StrEnum):
    """What a policy's alias serves (docs/design.md#release-state)."""

    UNSET = "unset"
    """Claimed by its policy, never pointed at a release."""
    SERVING = "serving"
    """Serves a release that met the policy version that set it."""
    NONCOMPLIANT = "noncompliant"
    """Serves a release that does not meet the policy's current version, kept because the
    policy says ``on_noncompliant: keep`` (shown red everywhere)."""
    REVOKED = "revoked"
    """Serves nothing: the policy's current version could not be met."""


class FindingKind(StrEnum):
    """A disagreement ``dpmerge registry verify`` finds between MLflow and the release-state
    store or the signatures (docs/design.md#release-state)."""

    STATE_UNREADABLE = "state_unreadable"
    LEDGER_LACKS_RELEASE = "ledger_lacks_release"
    ALIAS_DRIFT = "alias_drift"
    UNMANAGED_ALIAS = "unmanaged_alias"
    SERVED_UNCOUNTED = "served_uncounted"
    RELEASE_UNSIGNED = "release_unsigned"
    CARD_MISMATCH = "card_mismatch"
    FILES_MISMATCH = "files_mismatch"
    NONCOMPLIANT = "noncompliant"
    QUARANTINED_PARENT = "quarantined_parent"
    """A served release whose candidates include a quarantined one: revoked on repair."""
    SERVING_STATEMENT = "serving_statement"
    """A served alias whose signed serving statement consumers would refuse (missing, expired,
    not the workflow's, another version): re-issued on repair."""
    QUARANTINE_DRIFT = "quarantine_drift"
    CANDIDATE_FORGED = "candidate_forged"
    REQUEST_REJECTED = "request_rejected"
    """An object under an operator's prefix that is no valid request: never applied."""
    POOL_TEMPLATE_DRIFT = "pool_template_drift"
    """A stack's work pool whose base job template is not the provisioned one: set back
    (``verify-state``, devstack/provision.py)."""
    WORKERS_NOT_SEPARATED = "workers_not_separated"
    """A stack's worker or dispatcher running as the state directory's owner, not as the worker
    user (``up`` not as root; devstack/worker_user.py): reported by ``stack status``."""


class CardCheck(StrEnum):
    """What ``registry show`` found of a release's card against its signature
    (docs/design.md#security)."""

    SIGNED = "signed"  # the description and the run's card are the signed card
    EDITED = "edited"  # either differs from the card the manifest signs
    UNSIGNED = "unsigned"  # the manifest does not verify, or the tags differ from it
    UNCHECKED = "unchecked"  # no public key given, or the run's card cannot be read


class BoundKind(StrEnum):
    """The analysis behind a reported ε."""

    CANDIDATE = "candidate"
    SELECTION = "selection"
    MIXTURE = "mixture"
    """A secret draw between LC merges: the mixture of their generic bounds' curves."""
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
    TABLE = "table"
    """A Parquet or CSV table named by a spec file (docs/design.md#your-data)."""
    IMAGE_FOLDER = "image-folder"
    """A folder of images in class sub-folders named by a spec file (docs/design.md#your-data)."""
    NPZ = "npz"
    """A NumPy ``.npz`` of declared arrays named by a spec file (docs/design.md#your-data)."""
    HF_DATASET = "hf-dataset"
    """A Hugging Face dataset saved to disk, named by a spec file (docs/design.md#your-data)."""
    TOKENS = "tokens"
    """Token sequences in an ``.npz`` file, for a transformer (docs/design.md#fine-tuning)."""


class SplitName(StrEnum):
    """The parts a dataset is split into (docs/design.md#your-data)."""

    TRAIN = "train"
    VALIDATION = "validation"
    TEST = "test"


class ModelName(StrEnum):
    """The architectures :mod:`dpmerge.models` builds and a record's ``model.json`` names."""

    LOGREG = "logreg"
    CNN = "cnn"
    RESNET18_GN = "resnet18_gn"
    TRANSFORMERS = "transformers"
    """A transformers model from a local directory, DP fine-tuned on a declared parameter
    subset (docs/design.md#fine-tuning)."""


class GradSampleMode(StrEnum):
    """How per-example gradients are computed: the exact linear engine, an Opacus mode,
    ``vmap`` (``torch.func.vmap(grad)`` over the batch) or ``layers`` (one batched backward
    pass, each parameter layer's closed form), the last two clipped and noised by Opacus."""

    LINEAR_EXACT = "linear-exact"
    HOOKS = "hooks"
    FUNCTORCH = "functorch"
    EW = "ew"
    GHOST = "ghost"
    VMAP = "vmap"
    LAYERS = "layers"


class Engine(StrEnum):
    """The code that runs the DP-SGD mechanism (docs/training.md, "Engines")."""

    LINEAR_EXACT = "linear-exact"
    OPACUS = "opacus"


class RegistryKind(StrEnum):
    """Which registry a command uses (:mod:`dpmerge.locate`), named in its output."""

    EMBEDDED = "embedded"
    """A local sqlite file: the embedded state (``$DPMERGE_HOME`` or ./.dpmerge) or another."""
    STACK = "stack"
    """The local stack's MLflow server (``dpmerge stack up``)."""
    SERVER = "server"
    """Any other tracking server or database, given by ``--tracking-uri`` or the environment."""


class ExitCode(IntEnum):
    """What a ``dpmerge`` command's exit status means (README, "Outcomes"): the same for every
    command, in-process or through a server. :func:`dpmerge.exits.exit_code` maps an error's
    type onto it."""

    OK = 0
    FAILURE = 1
    """An outage (MLflow, S3 or the Prefect server unreachable or failing) or a bug."""
    REFUSED = 2
    """Bad input, or a request refused before anything changed (one line says why)."""
    INFEASIBLE = 3
    """No merge meets the target; the reachable range is reported."""
    NOT_PROMOTED = 4
    """A promotion gate failed; the alias stays where it was."""
    SUPERSEDED = 5
    """A later event of the same policy takes precedence; nothing was touched."""
    INTERRUPTED = 130
    """Ctrl-C (128 + SIGINT), as a shell reports it."""
    BROKEN_PIPE = 141
    """The reader of the output went away (128 + SIGPIPE, e.g. ``dpmerge … | head``)."""


def values(vocabulary: type[StrEnum]) -> tuple[str, ...]:
    """The plain string values of ``vocabulary``, in declaration order (CLI ``choices``)."""
    return tuple(member.value for member in vocabulary)


class KeyPurpose(StrEnum):
    """What the workflow's secret key is used for; each purpose derives its own sub-key
    (domain separation, docs/design.md#security)."""

    DATASET_ID = "dataset-id/v1"
    """The published dataset identifier: a keyed hash of the training-data fingerprint."""
    LINEAGE_ID = "lineage-id/v1"
    """Published noise and batch lineages and run ids: keyed hashes, so no seed shows."""
    KEY_ID = "key-id/v1"
    """A short public identifier of the key itself (which key signed a record)."""
    RELEASE_SIGNING = "release-signing/v1"
    """The seed of the workflow's Ed25519 release-signing key: releases are signed so that
    anyone with the public key can verify them (docs/design.md#security)."""
    STATE_DOCUMENT = "state-document/v1"
    """HMAC over a release-state document a gate trusts (the ledger, owners, serving
    pointers): a change made outside the workflow fails closed (docs/design.md#release-state)."""
    IMPORT_ATTESTATION = "import-attestation/v1"
    """HMAC over an imported candidate's attestation (record, weights digest, attester), made
    at import by the workflow identity (docs/design.md#imported-candidates)."""


class ProfileKind(StrEnum):
    """The privacy profile an imported candidate arrives with
    (docs/design.md#imported-candidates)."""

    RECORD = "record"
    """A DP-SGD mechanism record (σ, q, steps, clip, sampling, neighbouring, …)."""
    OPACUS = "opacus"
    """Read from the history of an Opacus ``PrivacyEngine`` accountant in the checkpoint."""
    RDP = "rdp"
    """An RDP curve: orders α → ε_α."""
    EPSILON_DELTA = "epsilon_delta"
    """An ε(δ) curve: pairs (ε, δ) the mechanism satisfies."""


class WeightsFormat(StrEnum):
    """The weight files ``dpmerge candidates import`` reads (docs/design.md#imported-candidates)."""

    SAFETENSORS = "safetensors"
    STATE_DICT = "state_dict"
    """A torch state dict saved with ``torch.save`` (read with ``weights_only=True``)."""
    OPACUS = "opacus"
    """A ``PrivacyEngine.save_checkpoint`` file: its ``module_state_dict``."""


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
