"""Typed errors. Every refusal carries a one-line, user-facing message.

What an error means for a command's exit status is decided by its type alone, in one table
(:mod:`dpmerge.exits`): an :class:`OutageError` exits 1, :class:`InfeasibleTargetError` 3,
:class:`NotPromotedError` 4, every other error dpmerge raises on purpose 2 (bad input or a
refusal). Errors are classified where they arise, by the failing call's type, error code or
status, never later from their message text.
"""

from __future__ import annotations


class DPMergeError(Exception):
    """Base class of every error dpmerge raises on purpose."""


class InputError(DPMergeError, ValueError):
    """Bad input from a user (a policy, a command-line value, a file): refused with one line
    before anything changes. Catch this to catch every kind of bad input."""


class RecordError(InputError):
    """A mechanism record or privacy label is missing a field or holds a wrong value."""


class ModelFactoryError(InputError):
    """A model factory ``module:callable`` (docs/design.md#your-model) that cannot be used: a
    malformed reference, a module or attribute not found, a factory that raises or returns no
    fitting ``torch.nn.Module``, a module Opacus refuses, or a source that changed since the
    weights were trained."""


class FactoryMismatchError(RecordError):
    """Candidates built by different model factories, or by one factory's different sources
    (its sha256), given to one merge (docs/design.md#your-model)."""


class BaseModelError(InputError):
    """A fine-tuning base that cannot be used as declared: its directory missing or not a
    transformers model, its files not those of the recorded digest, LoRA targets or trained
    layers naming no module, its labels not the data's classes (docs/design.md#fine-tuning)."""


class DifferentBasesError(RecordError):
    """Candidates fine-tuned from different base models (their digests differ): their trained
    parameters do not merge (docs/design.md#fine-tuning)."""


class RefusalError(DPMergeError, ValueError):
    """The requested analysis is not valid for these candidates (docs/design.md#mechanism-record,
    docs/design.md#structured-bound)."""


class UnsupportedError(DPMergeError):
    """An accountant cannot analyse this mechanism (dp_accounting's ``UnsupportedEventError``):
    an RDP-only label has no PLD, an (ε, δ) label has no RDP curve, a PLD would exceed the
    grid the accountant supports. The one channel for "not supported"; callers that can fall
    back to the other accountant catch it, and ``accountant`` says which one refused."""

    def __init__(self, accountant: str, message: str) -> None:
        super().__init__(message)
        self.accountant = accountant


class BoundContradictionError(DPMergeError):
    """Two bounds that must be ordered are not (e.g. a structured LC bound above the generic
    bound over the same release units, docs/design.md#structured-bound). This is a bug in one
    of them: it is raised, never clamped away."""


class InfeasibleTargetError(DPMergeError):
    """No merge of the candidates meets the target (docs/design.md#calibration).

    Carries the reachable ε range so callers can print it or put it into JSON, and, where a
    DP-SGD candidate sets the bottom of that range, the noise multiplier a new candidate with
    its sample rate and steps needs to reach the target (PLD, rounded up).
    """

    def __init__(
        self,
        message: str,
        *,
        target_epsilon: float,
        delta: float,
        reachable_epsilon_range: tuple[float, float],
        required_noise_multiplier: float | None = None,
    ) -> None:
        super().__init__(message)
        self.target_epsilon = target_epsilon
        self.delta = delta
        self.reachable_epsilon_range = reachable_epsilon_range
        self.required_noise_multiplier = required_noise_multiplier


class IntegrityError(DPMergeError):
    """Stored state fails a check that protects a privacy claim: a record whose signature does
    not verify, a release ledger that cannot be read or disagrees with the registry. Never
    retried, never read as empty; the message names the repair (docs/design.md#security)."""


class AccessError(DPMergeError):
    """This environment's credentials do not reach what the command needs (a role without
    it, docs/stack.md#roles-and-permissions): refused in one line before anything changes, and
    never replaced by a local stand-in."""


class DatasetError(DPMergeError):
    """A dataset is missing or malformed; the message says which package or folder provides it."""


class NotPromotedError(DPMergeError):
    """A promotion gate failed: the release was not promoted and the alias stays where it was
    (docs/design.md#registry)."""


class OutageError(DPMergeError):
    """An external system (MLflow, S3, the Prefect server, the local stack) failed or cannot
    be reached: not the user's input, so a command exits 1 (README, "Outcomes")."""


class TransientError(OutageError):
    """An external system (MLflow, S3) failed in a way worth retrying: unreachable, timed out,
    overloaded or locked. The adapters raise it where the failure's *type* says so (an
    exception class, an error code, an HTTP status), never from message text
    (docs/design.md#workflow)."""


def is_transient(error: BaseException) -> bool:
    """Worth retrying: a :class:`TransientError`, or the standard library's connection and
    timeout errors. Refusals, bad input and anything else are not."""
    return isinstance(error, TransientError | ConnectionError | TimeoutError)
