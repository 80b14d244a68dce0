"""The registry's errors: a refused operation (bad input: a version, alias or model that is not
there, a request the tracking server rejects), a failure of the tracking server or its
database, temporary or not (told apart by :func:`registry_error` from the failure's type, MLflow
error code or HTTP status), and a refused promotion. What each means for a command's exit
status follows from its bases (:mod:`dpmerge.exits`)."""

from __future__ import annotations

from collections.abc import Sequence

import requests

from dpmerge.errors import (
    DPMergeError,
    IntegrityError,
    NotPromotedError,
    OutageError,
    TransientError,
)

TEMPORARY_HTTP_STATUS = frozenset({429, 503, 504})
"""HTTP statuses of a temporary failure. MLflow maps its error codes onto them:
``REQUEST_LIMIT_EXCEEDED`` and ``RESOURCE_EXHAUSTED`` (429), ``TEMPORARILY_UNAVAILABLE`` (503;
also what its SQL store raises for a database error such as a locked sqlite file),
``DEADLINE_EXCEEDED`` (504)."""

PERMISSION_STATUS = frozenset({401, 403})
"""HTTP statuses of a request the server refused for this user (MLflow's auth app answers
``PERMISSION_DENIED`` with 403, missing or wrong credentials with 401)."""

TEMPORARY_ERRORS: tuple[type[BaseException], ...] = (
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.RetryError,  # MLflow's own retries of 429/5xx ran out
    requests.exceptions.ChunkedEncodingError,
    ConnectionError,
    TimeoutError,
)
"""Network failures worth retrying (requests wraps urllib3's). MLflow's REST client re-raises
them as a plain ``MlflowException`` inside its ``except`` block, so they are found on the
exception's chain of causes."""


class RegistryError(DPMergeError):
    """A registry operation was refused; the message names model and version."""


class RegistryFailureError(RegistryError, OutageError):
    """The tracking server or its database failed (an HTTP 5xx, an error that is not MLflow's
    answer to the request): an outage or a bug, not bad input."""


class RegistryUnavailableError(RegistryFailureError, TransientError):
    """The tracking server or its database failed temporarily (unreachable, timed out, 429,
    503, 504, a locked sqlite database): worth retrying."""


class RegistryPermissionError(RegistryError):
    """The tracking server refused the request for this user (HTTP 401 or 403): the role's
    credentials do not allow it (docs/stack.md#roles-and-permissions)."""


class RecordIntegrityError(RegistryError, IntegrityError):
    """A candidate's stored record fails verification: its signature does not match its files
    (changed after registration, unsigned, or signed with another key)."""


class GateError(RegistryError, NotPromotedError):
    """Promotion refused: a gate failed. The alias was not moved."""

    def __init__(self, name: str, version: str, reasons: Sequence[str]) -> None:
        super().__init__(f"{name} v{version} not promoted: " + "; ".join(reasons))
        self.reasons = tuple(reasons)


def registry_error(message: str, error: BaseException) -> RegistryError:
    """``message`` as the error ``error`` is, found from its type, MLflow error code or HTTP
    status on its whole chain of causes: :class:`RegistryUnavailableError` for a temporary
    failure; :class:`RegistryPermissionError` for a request refused for this user (401, 403);
    :class:`RegistryError` for MLflow's answer that the request itself is wrong (a 4xx:
    invalid, not found, denied); :class:`RegistryFailureError` for anything else (a 5xx, or a
    failure that is not MLflow's answer at all)."""
    from mlflow.exceptions import MlflowException  # here: reading the registry imports no MLflow

    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        temporary_status = (
            isinstance(cause, MlflowException)
            and cause.get_http_status_code() in TEMPORARY_HTTP_STATUS
        )
        if temporary_status or isinstance(cause, TEMPORARY_ERRORS):
            return RegistryUnavailableError(message)
        cause = cause.__cause__ or cause.__context__
    if isinstance(error, MlflowException) and error.get_http_status_code() in PERMISSION_STATUS:
        return RegistryPermissionError(message)
    if isinstance(error, MlflowException) and error.get_http_status_code() < 500:
        return RegistryError(message)
    return RegistryFailureError(message)
