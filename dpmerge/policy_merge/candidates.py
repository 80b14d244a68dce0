"""The ready candidate versions a policy merges (step 1), and loading them, cached by content
hash and verified against their signatures; candidates trained with fixed seeds are refused
(docs/design.md#sharp-edges)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dpmerge.errors import InputError, RefusalError
from dpmerge.locate import command
from dpmerge.publication import FINGERPRINT_MARK, dataset_id, fixed_seed_streams
from dpmerge.registry import (
    ROLE_CANDIDATE,
    STATUS_READY,
    RegisteredCandidate,
    Registry,
    RegistryError,
    StoredVersion,
    candidate_content_hash,
)
from dpmerge.registry.names import CANDIDATES_SUFFIX, RELEASES_SUFFIX
from dpmerge.state import StateStore
from dpmerge.state.quarantine import quarantined

TRAIN_DEPLOYMENT = "train-candidates/train-candidates"
"""The deployment that trains candidates on a server (deployments/prefect.yaml)."""


class NoCandidatesError(RegistryError, InputError):
    """A policy's dataset and model name no usable candidates: none are ready, several
    trainings match and the policy does not say which, or every one is quarantined."""


@dataclass(frozen=True)
class CandidatePool:
    """The ready candidate versions a policy merges, and where its releases go."""

    registered_model: str
    merged_model: str
    dataset: str  # the published dataset identifier (keyed), never the fingerprint
    model: str
    versions: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _dataset_matches(policy_dataset: str, identifier: str) -> bool:
    return identifier == policy_dataset or identifier.startswith(f"{policy_dataset}-hmac:")


def releases_model_name(candidates_model: str) -> str:
    """The releases' registered model that goes with a candidates' registered model."""
    stem = candidates_model.removesuffix(f"-{CANDIDATES_SUFFIX}")
    return f"{stem}-{RELEASES_SUFFIX}"


def find_candidates(
    registry: Registry, dataset: str, model: str, state: StateStore | None = None
) -> CandidatePool:
    """The ready candidates of ``model`` trained on ``dataset``: a dataset name such as
    ``fashion-mnist``, or to pick one among several trainings its published identifier
    ``fashion-mnist-hmac:…`` (or its fingerprint ``…-sha256:…``, turned into the identifier with
    the workflow's key). Versions quarantined in the release-state ``state`` are left out,
    whatever their MLflow tags say. Raises :class:`RegistryError` when there are none or the
    name is ambiguous (:class:`NoCandidatesError`)."""
    if FINGERPRINT_MARK in dataset:
        dataset = dataset_id(dataset, registry.keys)
    groups: dict[tuple[str, str], list[str]] = {}
    for v in registry.ready_candidates(model=model):
        if _dataset_matches(dataset, v.tags.get("dp.dataset", "")):
            groups.setdefault((v.name, v.tags["dp.dataset"]), []).append(v.version)
    if not groups:
        raise NoCandidatesError(
            f"no ready candidates of model {model!r} on dataset {dataset!r} at "
            f"{registry.tracking_uri}; train some first: `{command('demo')}` (embedded) or "
            f"`{command('deployment', 'run', TRAIN_DEPLOYMENT, '--watch', tool='prefect')}`"
        )
    if len(groups) > 1:
        listed = ", ".join(f"{fp} ({name})" for name, fp in sorted(groups))
        raise NoCandidatesError(
            f"candidates of {model!r} on {dataset!r} come from several trainings: {listed}; "
            "put one of these identifiers in the policy's dataset to choose"
        )
    (name, identifier), versions = next(iter(groups.items()))
    if state is not None:
        out = quarantined(state, name)
        versions = [v for v in versions if v not in out]
        if not versions:
            raise NoCandidatesError(
                f"every ready candidate of {name} is quarantined ({', '.join(sorted(out))}); "
                "train new candidates"
            )
    return CandidatePool(
        registered_model=name,
        merged_model=releases_model_name(name),
        dataset=identifier,
        model=model,
        versions=tuple(sorted(versions, key=int)),
    )


def refuse_fixed_seeds(candidates: Sequence[RegisteredCandidate]) -> None:
    """Refuse a merge over candidates trained with a fixed (user-given, so not secret) noise or
    batch seed: their randomness is public, which voids the Gaussian mechanism or the
    amplification by subsampling (docs/design.md#sharp-edges)."""
    fixed = [
        f"{c.name} v{c.version} ({' and '.join(streams)})"
        for c in candidates
        if c.model_dir.record is not None and (streams := fixed_seed_streams(c.model_dir.record))
    ]
    if fixed:
        raise RefusalError(
            f"candidates trained with a fixed seed cannot be released: {'; '.join(fixed)}. A "
            "fixed --noise-seed or --batch-seed is public randomness and voids the guarantee; "
            "take them out of use (`dpmerge registry quarantine MODEL VERSION`) and train "
            "candidates without seeds"
        )


def load_candidates(
    registry: Registry,
    pool: CandidatePool,
    dest: str | Path,
    *,
    cache_dir: str | Path | None = None,
) -> list[RegisteredCandidate]:
    """The pool's candidate versions as model directories, each verified against its content
    hash and signature (:meth:`Registry.verify_candidate`). A registered version never changes,
    so with ``cache_dir`` each one is kept there under its content hash and reused when the
    files still hash to the version's ``dp.content_hash`` (otherwise downloaded again)."""
    if cache_dir is None:
        return registry.load_candidates(pool.registered_model, pool.versions, dest=dest)
    cache = Path(cache_dir)
    found: dict[str, RegisteredCandidate] = {}
    missing = []
    versions = registry.get_versions(pool.registered_model, pool.versions)
    for version, stored in zip(pool.versions, versions, strict=True):
        path = _cached(stored, cache)
        if path is None:
            missing.append(version)
            continue
        found[version] = registry.verify_candidate(stored, path)
    if missing:
        for item in registry.load_candidates(pool.registered_model, missing, dest=dest):
            found[item.version] = item
            target = cache / candidate_content_hash(item.model_dir.path)
            staging = cache / f".{target.name}.{uuid.uuid4().hex[:8]}"
            shutil.copytree(item.model_dir.path, staging)
            shutil.rmtree(target, ignore_errors=True)  # a stale entry failed its hash check
            with suppress(OSError):
                os.replace(staging, target)
            shutil.rmtree(staging, ignore_errors=True)
    return [found[v] for v in pool.versions]


def _cached(stored: StoredVersion, cache: Path) -> Path | None:
    """The cache entry of a ready candidate version whose files still hash to its content
    hash, else ``None`` (to download)."""
    tags = stored.tags
    content_hash = tags.get("dp.content_hash", "")
    path = cache / content_hash
    ready = tags.get("dp.role") == ROLE_CANDIDATE and tags.get("dp.status") == STATUS_READY
    if not (ready and content_hash and path.is_dir()):
        return None
    try:
        return path if candidate_content_hash(path) == content_hash else None
    except OSError:
        return None
