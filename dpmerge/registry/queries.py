"""What the registry reads for its callers: ready versions by content hash or by candidate,
one version's tags and privacy card, the rows of ``dpmerge registry ls``, aliases and their
owners, the releases the ledger must count, and the candidates' model directories (downloaded,
checked against their content hash and their signature). Every search goes through
:func:`~dpmerge.registry.filters.search_filter`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import mlflow

from dpmerge.artifacts import ModelDir, load_model_dir
from dpmerge.keys import WorkflowKey
from dpmerge.publication import signature_ok
from dpmerge.registry.catalog import summaries
from dpmerge.registry.connection import EXTRA_DIR, MlflowConnection
from dpmerge.registry.errors import RecordIntegrityError, RegistryError
from dpmerge.registry.filters import search_filter
from dpmerge.registry.names import candidate_content_hash, slug
from dpmerge.registry.tags import (
    ALIAS_OWNER_TAG,
    RELEASED_TAG,
    ROLE_CANDIDATE,
    ROLE_MERGED,
    SIGNATURE_TAG,
    STATUS_READY,
)
from dpmerge.registry.versions import RegisteredCandidate, StoredVersion, VersionSummary


class RegistryQueries(MlflowConnection):
    """The registry's reads (see the module docstring); :class:`~dpmerge.registry.Registry`
    adds the writes. ``keys`` is the workflow's secret key (default: loaded on first use by
    :meth:`WorkflowKey.from_env`), which verifies candidate signatures."""

    def __init__(
        self, tracking_uri: str | None, artifact_root: str | None, keys: WorkflowKey | None
    ) -> None:
        super().__init__(tracking_uri, artifact_root)
        self._keys = keys

    @property
    def keys(self) -> WorkflowKey:
        if self._keys is None:
            self._keys = WorkflowKey.from_env()
        return self._keys

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

    def alias_owner(self, name: str, alias: str) -> str | None:
        """The policy that owns ``alias`` of ``name``: the owner recorded when a policy first set
        it, else (an alias set before owners were recorded) the policy of the version it names;
        ``None`` for an alias nobody set."""
        tags = self._model_tags(name)
        if tags is None:
            return None
        if tags.get(ALIAS_OWNER_TAG + alias):
            return tags[ALIAS_OWNER_TAG + alias]
        version = self._aliases(name).get(alias)
        return self.get_version(name, version).tags.get("dp.policy") if version else None

    def find_ready_version(self, name: str, content_hash: str) -> StoredVersion | None:
        """The ready version of ``name`` with this content hash (a release already registered:
        a flow can check this before merging, so RS draws once per release)."""
        found = self._search(search_filter(name, {"dp.content_hash": content_hash}))
        ready = [v for v in found if v.tags.get("dp.status") == STATUS_READY]
        return min(ready, key=lambda v: int(v.version)) if ready else None

    def versions_with_hash(self, name: str, content_hash: str) -> list[StoredVersion]:
        """Every version of ``name`` with this content hash, whatever its status."""
        return self._search(search_filter(name, {"dp.content_hash": content_hash}))

    def released_versions(self, dataset: str | None = None) -> list[StoredVersion]:
        """The merged versions (of ``dataset``, a published identifier, if given) that a release
        ledger recorded (tag ``dp.released``): the ledger must hold them all."""
        tags = {"dp.role": ROLE_MERGED, RELEASED_TAG: "true"}
        if dataset is not None:
            tags["dp.dataset"] = dataset
        return self._search(search_filter(tags=tags))

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

    def list_versions(
        self, name: str | None = None, *, internal: bool = False
    ) -> list[VersionSummary]:
        """Every candidate and merged version (of ``name`` if given), by name and version.
        Candidates' accuracies are internal (beside an RS release's accuracy they name the
        drawn candidate, docs/design.md#rs-secrecy): left out unless ``internal``."""
        found = [
            v
            for role in (ROLE_CANDIDATE, ROLE_MERGED)
            for v in self._search(search_filter(name or None, {"dp.role": role}))
        ]
        return summaries(found, self._aliases, internal=internal)

    def verify_candidate(self, stored: StoredVersion, path: Path) -> ModelDir:
        """Load the candidate directory ``path`` of version ``stored`` after checking that its
        files hash to the version's ``dp.content_hash`` and that this hash carries the
        workflow's signature; :class:`RecordIntegrityError` (with the repair) otherwise."""
        where = f"{stored.name} v{stored.version}"
        content_hash = candidate_content_hash(path)
        if content_hash != stored.tags.get("dp.content_hash"):
            raise RecordIntegrityError(
                f"{where}: its files do not match dp.content_hash; "
                f"{repair_hint(stored.name, stored.version)}"
            )
        if not signature_ok(content_hash, stored.tags.get(SIGNATURE_TAG), self.keys):
            why = "unsigned" if not stored.tags.get(SIGNATURE_TAG) else "signature mismatch"
            raise RecordIntegrityError(
                f"{where}: its record fails verification ({why}; key {self.keys.key_id}, "
                f"signed with {stored.tags.get('dp.key_id', 'no key')}); "
                f"{repair_hint(stored.name, stored.version)}"
            )
        return load_model_dir(path)

    def load_candidates(
        self,
        name: str,
        versions: Sequence[str | int] | None = None,
        *,
        dest: str | Path,
    ) -> list[RegisteredCandidate]:
        """Download ready candidate versions (default: all) into ``dest``, verify each
        (:meth:`verify_candidate`), load."""
        if versions is None:
            found = self._search(search_filter(name, {"dp.role": ROLE_CANDIDATE}))
            versions = [v.version for v in found if v.tags.get("dp.status") == STATUS_READY]
        if not versions:
            raise RegistryError(f"no ready candidate versions in {name}")
        root = Path(dest)
        result = []
        for version in sorted({str(v) for v in versions}, key=int):
            stored = self.get_version(name, version)
            tags = stored.tags
            if tags.get("dp.role") != ROLE_CANDIDATE or tags.get("dp.status") != STATUS_READY:
                raise RegistryError(f"{name} v{version} is not a ready candidate version")
            path = self.download_candidate(name, version, root)
            model_dir = self.verify_candidate(stored, path)
            result.append(RegisteredCandidate(name, version, model_dir))
        return result

    def download_candidate(self, name: str, version: str | int, dest: str | Path) -> Path:
        """The dpmerge files of a version, downloaded under ``dest`` (not verified)."""
        mv = self._version(name, str(version))
        with self._errors(f"downloading {name} v{version}"):
            return Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=f"{mv.source.rstrip('/')}/{EXTRA_DIR}",
                    dst_path=str(Path(dest) / f"{slug(name, 80)}-v{version}"),
                    tracking_uri=self.tracking_uri,
                )
            )


def repair_hint(name: str, version: str) -> str:
    """What to do about a candidate whose record fails verification."""
    return (
        f"if its record was changed after registration, take it out of use with "
        f"`dpmerge registry quarantine {name} {version}` (and retrain); if it predates record "
        f"signing or the workflow key changed, check it against its run's params and re-sign "
        f"it with `dpmerge registry sign {name} {version}`"
    )
