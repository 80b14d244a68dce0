"""What the registry reads for its callers: ready versions by content hash or by candidate,
one version's tags and privacy card, the rows of ``dpmerge registry ls``, aliases and their
owners, the releases the ledger must count, and the candidates' model directories (downloaded,
checked against their content hash and their signature). Every search goes through
:func:`~dpmerge.registry.filters.search_filter`."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlflow

from dpmerge import manifests, serving_statement
from dpmerge.accounting.records import candidate_from_dict
from dpmerge.artifacts import load_model_dir
from dpmerge.errors import InputError
from dpmerge.keys import WorkflowKey
from dpmerge.privacy_card import CARD_JSON, CARD_MARKDOWN, PrivacyCard
from dpmerge.registry.catalog import summaries
from dpmerge.registry.connection import EXTRA_DIR, MlflowConnection
from dpmerge.registry.errors import RecordIntegrityError, RegistryError
from dpmerge.registry.filters import search_filter
from dpmerge.registry.names import candidate_content_hash, slug
from dpmerge.registry.tags import (
    MANIFEST_TAG,
    PUBLISHED_RECORD_TAG,
    ROLE_CANDIDATE,
    ROLE_MERGED,
    SIGNATURE_TAG,
    STATEMENT_TAG,
    STATUS_READY,
)
from dpmerge.registry.versions import (
    RegisteredCandidate,
    StoredVersion,
    VersionSummary,
)

MODEL_URI = re.compile(
    r"^models:/(?P<name>[^@/]+)(?:@(?P<alias>[A-Za-z0-9_-]+)|/(?P<version>[1-9][0-9]*))$"
)

READ_THREADS = 8
"""Versions read at once by :meth:`RegistryQueries.get_versions`."""


class RegistryQueries(MlflowConnection):
    """The registry's reads (see the module docstring); :class:`~dpmerge.registry.Registry`
    adds the writes. ``keys`` is the workflow's secret key (default: loaded on first use by
    :meth:`WorkflowKey.from_env`), which verifies candidate signatures."""

    def __init__(
        self,
        tracking_uri: str | None,
        artifact_root: str | None,
        keys: WorkflowKey | None,
        public_key: str | None = None,
    ) -> None:
        super().__init__(tracking_uri, artifact_root)
        self._keys = keys
        self._public_key = public_key

    @property
    def keys(self) -> WorkflowKey:
        """The workflow's secret key, to sign (default: loaded on first use); a registry made
        with only a ``public_key`` (an operator's, a consumer's) has none."""
        if self._keys is None:
            if self._public_key is not None:
                raise InputError(
                    "this needs the workflow's secret key, which only the workflow role holds"
                )
            self._keys = WorkflowKey.from_env()
        return self._keys

    @property
    def public_key(self) -> str:
        """The key every signature is verified with: the public half of the workflow's key,
        or for a registry without it the one given (``""``: ``$DPMERGE_RELEASE_PUBLIC_KEY``)."""
        if self._keys is None and self._public_key is not None:
            return self._public_key or manifests.configured_public_key()
        return manifests.public_key_hex(self.keys)

    def get_version(self, name: str, version: str | int) -> StoredVersion:
        """Version ``version`` of ``name`` with its tags; :class:`RegistryError` if missing."""
        return StoredVersion.of(self._version(name, str(version)))

    def get_versions(self, name: str, versions: Sequence[str]) -> list[StoredVersion]:
        """:meth:`get_version` of each of ``versions``, in order, read concurrently (one
        request each: a policy run reads every candidate's)."""
        with ThreadPoolExecutor(max(1, min(READ_THREADS, len(versions)))) as threads:
            return list(threads.map(lambda v: self.get_version(name, v), versions))

    def card_text(self, name: str, version: str | int) -> str:
        """The version's description: for a merged version its privacy card (Markdown)."""
        return self._version(name, str(version)).description or ""

    def aliases(self, name: str) -> dict[str, str]:
        """Alias -> version of registered model ``name``."""
        return self._aliases(name)

    def model_exists(self, name: str) -> bool:
        return self._model_tags(name) is not None

    def find_ready_version(
        self, name: str, content_hash: str, *, exclude: Collection[str] = ()
    ) -> StoredVersion | None:
        """The first ready version of ``name`` with this content hash whose signature
        verifies, versions in ``exclude`` (quarantined) left out: a release already registered,
        which a flow reuses instead of merging (so RS draws once per release). A version whose
        tags were changed after registration, or one planted without the workflow's key, is
        never returned."""
        found = self._search(search_filter(name, {"dp.content_hash": content_hash}))
        ready = [
            v
            for v in found
            if v.tags.get("dp.status") == STATUS_READY
            and v.version not in exclude
            and self.signed(v)
        ]
        return min(ready, key=lambda v: int(v.version)) if ready else None

    def signed(self, stored: StoredVersion) -> bool:
        """Whether ``stored`` carries the workflow's signature (its manifest verifies)."""
        try:
            self.manifest(stored)
        except manifests.ReleaseSignatureError:
            return False
        return True

    def manifest(self, stored: StoredVersion, public_key: str | None = None) -> manifests.Manifest:
        """The signed manifest of version ``stored``, verified under ``public_key`` (default
        :attr:`public_key`) and against the version's tags;
        :class:`~dpmerge.manifests.ReleaseSignatureError` otherwise."""
        tags = stored.tags
        key = public_key or self.public_key
        manifest = manifests.verify(tags.get(MANIFEST_TAG), tags.get(SIGNATURE_TAG), key)
        manifests.check_facts(manifest, tags)
        if (manifest.model, manifest.release) != (stored.name, tags.get("dp.content_hash")):
            raise manifests.ReleaseSignatureError(
                f"the manifest of {stored.name} v{stored.version} is another release's"
            )
        return manifest

    def versions_with_hash(self, name: str, content_hash: str) -> list[StoredVersion]:
        """Every version of ``name`` with this content hash, whatever its status."""
        return self._search(search_filter(name, {"dp.content_hash": content_hash}))

    def merged_versions(self, dataset: str | None = None) -> list[StoredVersion]:
        """Every merged version (of ``dataset``, a published identifier, if given), whatever
        its status: each one whose signature verifies had its evaluation published, so the
        release ledger must count it (docs/design.md#release-ledger)."""
        tags = {"dp.role": ROLE_MERGED}
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

    def verify_candidate(self, stored: StoredVersion, path: Path) -> RegisteredCandidate:
        """The candidate directory ``path`` of version ``stored``, loaded after checking that
        its files hash to the version's ``dp.content_hash`` and that its manifest — content
        hash, record as published, every signed tag — verifies under :attr:`public_key`;
        :class:`RecordIntegrityError` (with the repair) otherwise."""
        where = f"{stored.name} v{stored.version}"
        content_hash = candidate_content_hash(path)
        if content_hash != stored.tags.get("dp.content_hash"):
            raise RecordIntegrityError(
                f"{where}: its files do not match dp.content_hash; "
                f"{repair_hint(stored.name, stored.version)}"
            )
        try:
            self.manifest(stored)
        except manifests.ReleaseSignatureError as error:
            raise RecordIntegrityError(
                f"{where}: its record fails verification ({error}; signed with key "
                f"{stored.tags.get('dp.key_id', 'none')}); "
                f"{repair_hint(stored.name, stored.version)}"
            ) from None
        published = candidate_from_dict(json.loads(stored.tags[PUBLISHED_RECORD_TAG]))
        return RegisteredCandidate(stored.name, stored.version, load_model_dir(path), published)

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
            result.append(self.verify_candidate(stored, path))
        return result

    def bound_location(self, stored: StoredVersion, manifest: manifests.Manifest) -> str:
        """Where the files of version ``stored`` are read from (what MLflow's serving reads),
        once it is bound to its signed ``manifest``: that place must be the logged model the
        manifest names (docs/design.md#security). MLflow's registry keeps no model id of a
        version, only where its files are, so the place is what binds.
        :class:`~dpmerge.manifests.ReleaseSignatureError` otherwise: a version made by another
        hand, with a signed release's tags copied onto it."""
        location = self._download_uri(stored.name, stored.version)
        signed = self._logged_model_location(manifest.logged_model)
        if location.rstrip("/") != signed.rstrip("/"):
            raise manifests.ReleaseSignatureError(
                f"{stored.name} v{stored.version} reads its files from {location[:200]}, not "
                f"from the model its signed manifest names ({manifest.logged_model} at "
                f"{signed[:200]}): its signed tags were copied from another version"
            )
        return location

    def download_model(self, name: str, version: str | int, dest: str | Path) -> Path:
        """Every file of a version's MLflow model (what ``mlflow.pyfunc.load_model`` loads),
        downloaded under ``dest`` from where MLflow's serving reads it (not verified)."""
        location = self._download_uri(name, str(version))
        return self._download_model(name, str(version), location, dest)

    def _download_model(self, name: str, version: str, location: str, dest: str | Path) -> Path:
        with self._errors(f"downloading {name} v{version}"):
            return Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=location,
                    dst_path=str(Path(dest) / f"{slug(name, 80)}-v{version}-model"),
                    tracking_uri=self.tracking_uri,
                )
            )

    def verified_model(
        self, name: str, version: str | int, dest: str | Path, public_key: str
    ) -> tuple[manifests.Manifest, Path]:
        """A release's manifest and model files, downloaded under ``dest`` and checked against
        its Ed25519 signature under ``public_key``: its tags, that it is the model its manifest
        names (:meth:`bound_location`), and every file;
        :class:`~dpmerge.manifests.ReleaseSignatureError` when anything differs."""
        stored = self.get_version(name, version)
        manifest = self.manifest(stored, public_key)
        location = self.bound_location(stored, manifest)
        root = self._download_model(name, str(version), location, dest)
        manifests.check_files(manifest, root)
        return manifest, root

    def check_card(self, stored: StoredVersion, manifest: manifests.Manifest, root: Path) -> None:
        """The card consumers read of release ``stored`` — its version description (the card
        MLflow's UI shows) and its run's ``privacy_card.json`` — is exactly the signed card:
        the one in its verified model files ``root`` (from :meth:`verified_model`), whose digest
        the manifest signs. The expected description is derived from the signed card, never
        read from the registry (docs/design.md#security);
        :class:`~dpmerge.manifests.ReleaseSignatureError` otherwise."""
        subject = f"{stored.name} v{stored.version}"
        extra = root / EXTRA_DIR
        try:
            card = PrivacyCard(
                (extra / CARD_MARKDOWN).read_text(), json.loads((extra / CARD_JSON).read_text())
            )
        except (OSError, ValueError) as error:
            raise manifests.ReleaseSignatureError(
                f"{subject} carries no readable signed privacy card ({error})"
            ) from None
        if manifests.card_digest(card.description(), card.data) != manifest.card_digest:
            raise manifests.ReleaseSignatureError(
                f"the privacy card files of {subject} are not the card its manifest signs"
            )
        if self.card_text(stored.name, stored.version) != card.description():
            raise manifests.ReleaseSignatureError(
                f"the description of {subject} (the card MLflow shows) differs from its signed "
                f"privacy card (signed ε = {manifest.facts.get('dp.epsilon', '?')}): it was edited "
                "after registration, do not trust or serve it"
            )
        if stored.run_id and self._run_json(stored.run_id, CARD_JSON) != card.data:
            raise manifests.ReleaseSignatureError(
                f"the {CARD_JSON} of {subject}'s run differs from its signed privacy card: it "
                "was edited after registration, do not trust or serve it"
            )

    def resolve(self, model_uri: str) -> tuple[str, str]:
        """``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` as (name, version);
        :class:`RegistryError` for another form or an alias the model does not have."""
        match = MODEL_URI.match(model_uri)
        if match is None:
            raise RegistryError(
                f"expected models:/NAME@ALIAS or models:/NAME/VERSION, got {model_uri[:120]!r}"
            )
        name, alias, version = match["name"], match["alias"], match["version"]
        if alias is not None:
            aliases = self._aliases(name) if self.model_exists(name) else {}
            if alias not in aliases:
                raise RegistryError(f"{name} has no alias {alias!r} this user can see")
            version = aliases[alias]
        return name, str(version)

    def serving_statement(self, name: str, alias: str) -> str | None:
        """The workflow's signed serving statement for ``alias`` of ``name`` as stored (the
        registered-model tag; :mod:`dpmerge.serving_statement`), ``None`` when there is none."""
        return (self._model_tags(name) or {}).get(STATEMENT_TAG + alias)

    def resolve_served(self, model_uri: str, public_key: str) -> tuple[str, str]:
        """:meth:`resolve`, resolving an alias once; for ``models:/NAME@ALIAS`` only if the
        workflow's signed serving statement for the alias names the version it resolves to
        (:func:`dpmerge.serving_statement.check`; docs/design.md#security)."""
        name, version = self.resolve(model_uri)
        match = MODEL_URI.match(model_uri)
        alias = match["alias"] if match else None
        if alias is not None:
            serving_statement.check(
                self.serving_statement(name, alias),
                public_key,
                model=name,
                alias=alias,
                version=version,
            )
        return name, version

    def load_verified(self, model_uri: str, dest: str | Path, public_key: str) -> Any:
        """The release ``model_uri`` names as an MLflow pyfunc model, loaded from ``dest`` only
        after its files, tags and card were checked against its signature under ``public_key``
        (:meth:`verified_model`, :meth:`check_card`; docs/design.md#security);
        :class:`~dpmerge.manifests.ReleaseSignatureError` when they differ: swapped weights are
        never loaded."""
        name, version = self.resolve_served(model_uri, public_key)
        manifest, root = self.verified_model(name, version, dest, public_key)
        self.check_card(self.get_version(name, version), manifest, root)
        with self._errors(f"loading {model_uri}"):
            return mlflow.pyfunc.load_model(str(root))

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
    """What to do about a candidate whose record fails verification. Nothing re-signs a
    record after the fact from data an insider can write: only the training that produced a
    record signs it (docs/design.md#security)."""
    return (
        f"take it out of use with `dpmerge registry quarantine {name} {version}` and retrain "
        "the candidate (only the training that produced a record signs it)"
    )
