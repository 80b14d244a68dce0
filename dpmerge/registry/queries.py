"""What the registry reads for its callers: ready versions by content hash or by candidate,
one version's tags and privacy card, the rows of ``dpmerge registry ls``, aliases, and the
candidates' model directories (downloaded and checked against their content hash). Every
search goes through :func:`~dpmerge.registry.filters.search_filter`."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import mlflow

from dpmerge.artifacts import load_model_dir
from dpmerge.registry.catalog import summaries
from dpmerge.registry.connection import EXTRA_DIR, MlflowConnection
from dpmerge.registry.errors import RegistryError
from dpmerge.registry.filters import search_filter
from dpmerge.registry.names import candidate_content_hash, slug
from dpmerge.registry.tags import ROLE_CANDIDATE, ROLE_MERGED, STATUS_READY
from dpmerge.registry.versions import RegisteredCandidate, StoredVersion, VersionSummary


class RegistryQueries(MlflowConnection):
    """The registry's reads (see the module docstring); :class:`~dpmerge.registry.Registry`
    adds the writes."""

    def get_version(self, name: str, version: str | int) -> StoredVersion:
        """Version ``version`` of ``name`` with its tags; :class:`RegistryError` if missing."""
        return StoredVersion.of(self._version(name, str(version)))

    def card_text(self, name: str, version: str | int) -> str:
        """The version's description: for a merged version its privacy card (Markdown)."""
        return self._version(name, str(version)).description or ""

    def aliases(self, name: str) -> dict[str, str]:
        """Alias -> version of registered model ``name``."""
        return self._aliases(name)

    def model_exists(self, name: str) -> bool:
        return self._model_tags(name) is not None

    def find_ready_version(self, name: str, content_hash: str) -> StoredVersion | None:
        """The ready version of ``name`` with this content hash (a merge request already
        registered: a flow can check this before merging, so RS draws once per release)."""
        found = self._search(search_filter(name, {"dp.content_hash": content_hash}))
        ready = [v for v in found if v.tags.get("dp.status") == STATUS_READY]
        return min(ready, key=lambda v: int(v.version)) if ready else None

    def ready_candidates(
        self, *, model: str | None = None, candidate: str | None = None
    ) -> list[StoredVersion]:
        """Every ready candidate version, of any registered model, whose ``dp.model`` is
        ``model`` and whose ``dp.candidate`` (the record's name) is ``candidate``, where given."""
        tags = {"dp.role": ROLE_CANDIDATE, "dp.status": STATUS_READY}
        if model is not None:
            tags["dp.model"] = model
        if candidate is not None:
            tags["dp.candidate"] = candidate
        return self._search(search_filter(tags=tags))

    def list_versions(self, name: str | None = None) -> list[VersionSummary]:
        """Every candidate and merged version (of ``name`` if given), by name and version."""
        found = [
            v
            for role in (ROLE_CANDIDATE, ROLE_MERGED)
            for v in self._search(search_filter(name or None, {"dp.role": role}))
        ]
        return summaries(found, self._aliases)

    def load_candidates(
        self,
        name: str,
        versions: Sequence[str | int] | None = None,
        *,
        dest: str | Path | None = None,
    ) -> list[RegisteredCandidate]:
        """Download ready candidate versions (default: all) into ``dest`` (default a new
        temporary directory the caller owns), check each against its content hash, load."""
        if versions is None:
            found = self._search(search_filter(name, {"dp.role": ROLE_CANDIDATE}))
            versions = [v.version for v in found if v.tags.get("dp.status") == STATUS_READY]
        if not versions:
            raise RegistryError(f"no ready candidate versions in {name}")
        root = (
            Path(dest) if dest is not None else Path(tempfile.mkdtemp(prefix="dpmerge-candidates-"))
        )
        result = []
        for version in sorted({str(v) for v in versions}, key=int):
            mv = self._version(name, version)
            if mv.tags.get("dp.role") != ROLE_CANDIDATE or mv.tags.get("dp.status") != STATUS_READY:
                raise RegistryError(f"{name} v{version} is not a ready candidate version")
            with self._errors(f"downloading {name} v{version}"):
                path = mlflow.artifacts.download_artifacts(
                    artifact_uri=f"{mv.source.rstrip('/')}/{EXTRA_DIR}",
                    dst_path=str(root / f"{slug(name, 80)}-v{version}"),
                    tracking_uri=self.tracking_uri,
                )
            if candidate_content_hash(path) != mv.tags.get("dp.content_hash"):
                raise RegistryError(
                    f"{name} v{version}: downloaded files do not match dp.content_hash"
                )
            result.append(RegisteredCandidate(name, version, load_model_dir(path)))
        return result
