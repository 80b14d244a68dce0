"""A thin adapter over ``MlflowClient``: candidates and merged models with their privacy records.

Layout. Candidates of one dataset and architecture form one registered model
(``dpmerge-<dataset>-<model>-candidates``); the merges released from them form another
(``dpmerge-<dataset>-<model>-releases``), which carries the serving aliases. Their runs live in
two experiments (``dpmerge-candidates``, ``dpmerge-releases``) with two artifact prefixes
(``candidates/``, ``releases/``), so access rules can differ: candidate weights and metrics are
internal (publishing them voids every guarantee, and for RS comparing them with the release
would reveal the secret draw). ``<dataset>`` comes from the keyed dataset identifier, never the
training-data fingerprint (docs/design.md#security).

A version holds an MLflow ``pytorch`` model in the ``pt2`` format and, in its ``extra_files/``,
the dpmerge model directory from which :meth:`Registry.load_candidates` rebuilds exact weights
(:mod:`~dpmerge.registry.connection`). Metrics go to the run; the privacy record to version
tags (``dp.*``, key scalars only) and JSON artifacts.

Safety rules. A version is written fully, verified, and only then tagged ``dp.status=ready``; a
failure after creation tags it ``dp.status=failed``. The gates (:meth:`Registry.check_gates`)
read only signed facts, and an alias is set only as the projection of a serving pointer in the
release-state store (docs/design.md#release-state), so it never names a failed, half-registered
or unsigned version. ``dp.content_hash`` makes registration idempotent: for a merge it hashes
the *release* (parent versions, method, weights, δ, bound), never the weights (an RS output
equals one candidate's weights, so a weight hash would leak the drawn index) nor the target. A
candidate's registration signs its content hash with the workflow's key, and loading a candidate
verifies the signature: a record changed in the artifact store is refused. A merged version's
registration signs its facts (release hash, ε, δ, bound, accuracy, …), so a tag changed
afterwards or a version planted by someone without the key is never reused or promoted. The
merge record is reduced to its public keys before logging, and no tag, description or artifact
receives the RS draw.

The same code serves an MLflow server (``http://127.0.0.1:5000``, artifacts proxied to S3) and
the embedded default (a ``sqlite:///`` file with local artifacts).

This package is the only code that talks to MLflow: its client is private, callers get
dpmerge's own dataclasses (:class:`StoredVersion`, …), never an MLflow entity, and MLflow's
failures arrive as :class:`RegistryError` — as :class:`RegistryUnavailableError` (a
:class:`~dpmerge.errors.TransientError`) when their type, error code or HTTP status says they
are temporary, as :class:`RegistryFailureError` (an outage or a bug) when the server failed
otherwise (docs/design.md#registry).

Modules: :mod:`~dpmerge.registry.adapter` (the :class:`Registry`: registration, promotion,
aliases, reports), :mod:`~dpmerge.registry.queries` (its reads),
:mod:`~dpmerge.registry.connection` (the MLflow calls, search filters, error translation and
the pt2 upload),
:mod:`~dpmerge.registry.merged` (a merged version's card, tags and params),
:mod:`~dpmerge.registry.names` (names and content hashes), :mod:`~dpmerge.registry.tags`,
:mod:`~dpmerge.registry.versions` (what the registry returns), :mod:`~dpmerge.registry.errors`.

Reading the registry for people (``dpmerge registry ls|show``, a policy's check against what
is registered) goes through :mod:`~dpmerge.registry.catalog`, which imports neither MLflow nor
torch; the names below are therefore imported on first use (PEP 562), so that importing the
catalog does not import the adapter.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Registry": "adapter",
    "CARD_JSON": "connection",  # defined by dpmerge.privacy_card
    "CARD_MARKDOWN": "connection",
    "GateError": "errors",
    "RecordIntegrityError": "errors",
    "RegistryError": "errors",
    "RegistryFailureError": "errors",
    "RegistryUnavailableError": "errors",
    "candidate_content_hash": "names",
    "candidate_model_name": "names",
    "merged_model_name": "names",
    "release_hash": "names",
    "repair_hint": "queries",
    "ROLE_CANDIDATE": "tags",
    "ROLE_MERGED": "tags",
    "STATUS_FAILED": "tags",
    "STATUS_QUARANTINED": "tags",
    "STATUS_READY": "tags",
    "STATUS_REGISTERING": "tags",
    "tag_float": "tags",
    "ReleaseFacts": "versions",
    "RegisteredCandidate": "versions",
    "RegisteredVersion": "versions",
    "StoredVersion": "versions",
    "VersionSummary": "versions",
    "prepare_process": "connection",
    "warm_up_export": "connection",
}

__all__ = [
    "CARD_JSON",
    "CARD_MARKDOWN",
    "ROLE_CANDIDATE",
    "ROLE_MERGED",
    "STATUS_FAILED",
    "STATUS_QUARANTINED",
    "STATUS_READY",
    "STATUS_REGISTERING",
    "GateError",
    "RecordIntegrityError",
    "RegisteredCandidate",
    "RegisteredVersion",
    "Registry",
    "RegistryError",
    "RegistryFailureError",
    "RegistryUnavailableError",
    "ReleaseFacts",
    "StoredVersion",
    "VersionSummary",
    "candidate_content_hash",
    "candidate_model_name",
    "merged_model_name",
    "prepare_process",
    "release_hash",
    "repair_hint",
    "tag_float",
    "warm_up_export",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from dpmerge.registry.adapter import Registry
    from dpmerge.registry.connection import (
        CARD_JSON,
        CARD_MARKDOWN,
        prepare_process,
        warm_up_export,
    )
    from dpmerge.registry.errors import (
        GateError,
        RecordIntegrityError,
        RegistryError,
        RegistryFailureError,
        RegistryUnavailableError,
    )
    from dpmerge.registry.names import (
        candidate_content_hash,
        candidate_model_name,
        merged_model_name,
        release_hash,
    )
    from dpmerge.registry.queries import repair_hint
    from dpmerge.registry.tags import (
        ROLE_CANDIDATE,
        ROLE_MERGED,
        STATUS_FAILED,
        STATUS_QUARANTINED,
        STATUS_READY,
        STATUS_REGISTERING,
        tag_float,
    )
    from dpmerge.registry.versions import (
        RegisteredCandidate,
        RegisteredVersion,
        ReleaseFacts,
        StoredVersion,
        VersionSummary,
    )
