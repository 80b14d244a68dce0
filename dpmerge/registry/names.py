"""Registered-model names and content hashes.

Candidates of one dataset and architecture form one registered model
(``dpmerge-<dataset>-<model>``), the merges released from them another (``…-merged``). A
version's ``dp.content_hash`` makes registration idempotent: for a candidate it hashes the
directory's files, for a merge the *request* (never the merged weights: an RS output equals one
candidate's weights, so a weight hash would leak the drawn index).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dpmerge.artifacts import MODEL_FILE, RECORD_FILE, WEIGHTS_FILE
from dpmerge.registry.errors import RegistryError


def slug(text: str, limit: int = 40) -> str:
    """Lower-case ``text`` with runs of other characters turned into ``-``."""
    value = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit].strip("-")
    if not value:
        raise RegistryError(f"cannot make a registered-model name from {text!r}")
    return value


def dataset_slug(dataset: str) -> str:
    """``fashion-mnist-sha256:3f2a…`` -> ``fashion-mnist-3f2a9c1b``: readable, yet distinct
    for different training data."""
    match = re.fullmatch(r"(.+)-sha256:([0-9a-f]{8,})", dataset)
    return f"{slug(match[1])}-{match[2][:8]}" if match else slug(dataset)


def candidate_model_name(dataset: str, model: str) -> str:
    return f"dpmerge-{dataset_slug(dataset)}-{slug(model)}"


def merged_model_name(dataset: str, model: str) -> str:
    return f"{candidate_model_name(dataset, model)}-merged"


def _canonical(document: Any) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), default=str).encode()


def _dir_hash(path: Path, files: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode() + b"\0")
        with (path / name).open("rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()


def candidate_content_hash(path: str | Path) -> str:
    """Identity of a candidate directory: its weights, architecture and record files."""
    return _dir_hash(Path(path), (WEIGHTS_FILE, MODEL_FILE, RECORD_FILE))


def merge_request_hash(
    *,
    parent_model: str,
    parents: Sequence[str],
    method: str,
    weights: Sequence[float],
    delta: float,
    bound: str,
    policy: Mapping[str, Any],
) -> str:
    """Identity of a merge *request*; ``parents`` in the order of ``weights``. Independent of
    the merged weights, so for RS it carries nothing about the draw."""
    return hashlib.sha256(
        _canonical(
            {
                "schema": "dpmerge.merge_request/1",
                "parent_model": parent_model,
                "parents": [str(v) for v in parents],
                "method": method,
                "weights": [float(w) for w in weights],
                "delta": float(delta),
                "bound": bound,
                "policy": dict(policy),
            }
        )
    ).hexdigest()
