"""The ready candidate versions a policy merges (step 1), and loading them, cached by content
hash."""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dpmerge.artifacts import load_model_dir
from dpmerge.errors import DPMergeError
from dpmerge.locate import command
from dpmerge.registry import (
    ROLE_CANDIDATE,
    STATUS_READY,
    RegisteredCandidate,
    Registry,
    RegistryError,
    candidate_content_hash,
    candidate_model_name,
    merged_model_name,
)

TRAIN_DEPLOYMENT = "train-candidates/train-candidates"
"""The deployment that trains candidates on a server (deployments/prefect.yaml)."""


@dataclass(frozen=True)
class CandidatePool:
    """The ready candidate versions a policy merges, and where its releases go."""

    registered_model: str
    merged_model: str
    dataset: str  # the training-data fingerprint
    model: str
    versions: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _dataset_matches(policy_dataset: str, fingerprint: str) -> bool:
    return fingerprint == policy_dataset or fingerprint.startswith(f"{policy_dataset}-sha256:")


def find_candidates(registry: Registry, dataset: str, model: str) -> CandidatePool:
    """The ready candidates of ``model`` trained on ``dataset`` (a dataset name such as
    ``fashion-mnist``, or a full fingerprint ``fashion-mnist-sha256:…`` to pick one among
    several trainings). Raises :class:`RegistryError` when there are none or the name is
    ambiguous."""
    groups: dict[tuple[str, str], list[str]] = {}
    for v in registry.ready_candidates(model=model):
        if _dataset_matches(dataset, v.tags.get("dp.dataset", "")):
            groups.setdefault((v.name, v.tags["dp.dataset"]), []).append(v.version)
    if not groups:
        raise RegistryError(
            f"no ready candidates of model {model!r} on dataset {dataset!r} at "
            f"{registry.tracking_uri}; train some first: `{command('demo')}` (embedded) or "
            f"`{command('deployment', 'run', TRAIN_DEPLOYMENT, '--watch', tool='prefect')}`"
        )
    if len(groups) > 1:
        listed = ", ".join(f"{fp} ({name})" for name, fp in sorted(groups))
        raise RegistryError(
            f"candidates of {model!r} on {dataset!r} come from several trainings: {listed}; "
            "put the fingerprint in the policy's dataset to choose one"
        )
    (name, fingerprint), versions = next(iter(groups.items()))
    return CandidatePool(
        registered_model=name,
        merged_model=merged_model_name(fingerprint, model)
        if name == candidate_model_name(fingerprint, model)
        else f"{name}-merged",
        dataset=fingerprint,
        model=model,
        versions=tuple(sorted(versions, key=int)),
    )


def load_candidates(
    registry: Registry,
    pool: CandidatePool,
    dest: str | Path,
    *,
    cache_dir: str | Path | None = None,
) -> list[RegisteredCandidate]:
    """The pool's candidate versions as model directories. A registered version never changes,
    so with ``cache_dir`` each one is kept there under its content hash and reused when the
    files still hash to the version's ``dp.content_hash`` (otherwise downloaded again)."""
    if cache_dir is None:
        return registry.load_candidates(pool.registered_model, pool.versions, dest=dest)
    cache = Path(cache_dir)
    found: dict[str, RegisteredCandidate] = {}
    missing = []
    for version in pool.versions:
        tags = registry.get_version(pool.registered_model, version).tags
        content_hash = tags.get("dp.content_hash", "")
        path = cache / content_hash
        ready = tags.get("dp.role") == ROLE_CANDIDATE and tags.get("dp.status") == STATUS_READY
        if ready and content_hash and path.is_dir():
            with suppress(DPMergeError, OSError):
                if candidate_content_hash(path) == content_hash:
                    model_dir = load_model_dir(path)
                    found[version] = RegisteredCandidate(pool.registered_model, version, model_dir)
                    continue
        missing.append(version)
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
