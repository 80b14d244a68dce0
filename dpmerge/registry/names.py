"""Registered-model names and content hashes (docs/design.md#registry).

Candidates of one dataset and architecture form one registered model
(``dpmerge-<dataset>-<model>-candidates``, internal), the merges released from them another
(``dpmerge-<dataset>-<model>-releases``). ``<dataset>`` is the published dataset identifier's
name and 8 digits of its keyed hash (``dpmerge.publication.dataset_id``), never the training-data
fingerprint. A version's ``dp.content_hash`` makes registration idempotent: for a candidate it
hashes the directory's files, for a merge the *release* it is (candidates, method, weights,
δ, gating bound; never the merged weights: an RS output equals one candidate's weights, so a
weight hash would leak the drawn index; never the target: two targets whose calibration gives
the same merge share one version).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dpmerge.artifacts import MODEL_FILE, RECORD_FILE, WEIGHTS_FILE
from dpmerge.manifests import canonical
from dpmerge.registry.errors import RegistryError


def slug(text: str, limit: int = 40) -> str:
    """Lower-case ``text`` with runs of other characters turned into ``-``."""
    value = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit].strip("-")
    if not value:
        raise RegistryError(f"cannot make a registered-model name from {text!r}")
    return value


CANDIDATES_SUFFIX, RELEASES_SUFFIX = "candidates", "releases"


def dataset_slug(dataset: str) -> str:
    """``fashion-mnist-hmac:3f2a…`` -> ``fashion-mnist-3f2a9c1b``: readable, yet distinct
    for different training data."""
    match = re.fullmatch(r"(.+)-(?:hmac|sha256):([0-9a-f]{8,})", dataset)
    return f"{slug(match[1])}-{match[2][:8]}" if match else slug(dataset)


def _model_name(dataset: str, model: str, suffix: str) -> str:
    return f"dpmerge-{dataset_slug(dataset)}-{slug(model)}-{suffix}"


def candidate_model_name(dataset: str, model: str) -> str:
    """The candidates' registered model; ``dataset`` is the published dataset identifier."""
    return _model_name(dataset, model, CANDIDATES_SUFFIX)


def merged_model_name(dataset: str, model: str) -> str:
    """The releases' registered model (the serving aliases live here)."""
    return _model_name(dataset, model, RELEASES_SUFFIX)


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


def release_hash(
    *,
    parent_model: str,
    parents: Sequence[str],
    report: Mapping[str, Any],
    selection: Mapping[str, Any] | None = None,
) -> str:
    """Identity of a release: the candidates (``parents``, in the order of the privacy
    ``report``'s candidates), its method, weights (a mixture: its rungs' odds and weights), δ
    and gating bound, and for a release a private selection chose, that selection as its card
    states it (``selection``: ε, δ, mechanism, rows, options; the same merge published
    untuned is another release, whose card says the validation rows were not used).
    Independent of the merged weights (for RS and the mixture it carries nothing about the
    draw) and of the policy and target that asked for it (the same merge is one release,
    whoever asks)."""
    identity: dict[str, Any] = {
        "schema": "dpmerge.release/1",
        "parent_model": parent_model,
        "parents": [str(v) for v in parents],
        "method": report["method"],
        "weights": [float(w) for w in report.get("weights") or ()],
        "delta": float(report["delta"]),
        "bound": report["bound"],
    }
    if report.get("rungs"):
        identity["rungs"] = [
            {"probability": float(r["probability"]), "weights": [float(w) for w in r["weights"]]}
            for r in report["rungs"]
        ]
    if selection is not None:
        identity["selection"] = dict(selection)
    return hashlib.sha256(canonical(identity)).hexdigest()
