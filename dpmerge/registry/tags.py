"""The ``dp.*`` version tags: roles and statuses, tag values within every backend's limit,
numbers read back from tags, and the scalar metrics a version records."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dpmerge.registry.errors import RegistryError

ROLE_CANDIDATE, ROLE_MERGED = "candidate", "merged"
STATUS_REGISTERING, STATUS_READY, STATUS_FAILED = "registering", "ready", "failed"
STATUS_QUARANTINED = "quarantined"  # taken out of use by an operator (a record that failed)
TAG_VALUE_LIMIT = 5000  # bytes every MLflow backend stores for a tag value
SIGNATURE_TAG, KEY_ID_TAG = "dp.signature", "dp.key_id"  # a version's signature, its key
MANIFEST_TAG = "dp.manifest"  # a merged version's signed manifest (dpmerge.manifests)
PUBLISHED_RECORD_TAG = "dp.published_record"  # a candidate's record as published (JSON)
LIFECYCLE_TAGS = frozenset(
    {"dp.status", "dp.failure", "dp.registering_by", SIGNATURE_TAG, MANIFEST_TAG, KEY_ID_TAG}
)
"""The ``dp.*`` tags that may change after registration (status, why, who registers) or that
carry the signature itself; every other ``dp.*`` tag is a signed fact."""
SERVED_TAG = "dpmerge.serves."  # + alias: on a registered model, what the alias serves (display)
STATEMENT_TAG = "dpmerge.signed."  # + alias: the signed serving statement (serving_statement)
MLFLOW_ALIAS_LIMIT = 255  # MLflow's MAX_REGISTERED_MODEL_ALIAS_LENGTH
MLFLOW_TAG_KEY_LIMIT = 250  # MLflow's MAX_MODEL_REGISTRY_TAG_KEY_LENGTH
ALIAS_LIMIT = min(
    MLFLOW_ALIAS_LIMIT, MLFLOW_TAG_KEY_LIMIT - max(len(SERVED_TAG), len(STATEMENT_TAG))
)
"""Longest alias a policy may own: MLflow's own limit, and short enough that the registered
model's tags showing what it serves (``dpmerge.serves.<alias>``, ``dpmerge.signed.<alias>``) fit
MLflow's tag-key limit."""
FAILURE_TAG = "dp.failure"  # why a version was marked failed or quarantined
REGISTERING_BY_TAG = "dp.registering_by"  # host:pid of the process registering a version


def tag_value(value: Any) -> str:
    text = repr(float(value)) if isinstance(value, float) else str(value)
    if len(text.encode()) > TAG_VALUE_LIMIT:
        raise RegistryError(f"tag value longer than {TAG_VALUE_LIMIT} bytes: {text[:60]}…")
    return text


def tag_values(values: Mapping[str, Any]) -> dict[str, str]:
    """The tags of ``values`` that are set, as strings."""
    return {k: tag_value(v) for k, v in values.items() if v is not None}


def signed_facts(tags: Mapping[str, str]) -> dict[str, str]:
    """The tags a version's signature covers: its ``dp.*`` tags but the lifecycle ones."""
    return {k: v for k, v in tags.items() if k.startswith("dp.") and k not in LIFECYCLE_TAGS}


def tag_float(value: Any) -> float | None:
    """A tag's number; ``None`` when the tag is missing or not a number."""
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def scalar_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Finite numeric leaves of a (nested) metrics dict, keys joined with dots."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(scalar_metrics(value, f"{name}."))
        elif (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ):
            flat[name] = float(value)
    return flat
