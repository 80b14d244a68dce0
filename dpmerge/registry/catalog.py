"""The registry read for people, fast: ``dpmerge registry ls|show`` and a policy's check
against what is registered (docs/design.md#registry).

Importing MLflow and starting its sqlite store take seconds, longer than the question. The
catalog answers the same reads without either: from an MLflow server through its REST API
(``/api/2.0/mlflow/...``), from an embedded ``sqlite:///`` file by reading MLflow's registry
tables read-only (``mode=ro``: a missing file is an error, never created). Any other tracking
URI (a database server) goes through the MLflow client (:class:`ClientCatalog`). It returns the
same :class:`~dpmerge.registry.versions.StoredVersion` the registry does, and the rows of
``registry ls`` are built once, by :func:`summaries`, for both.

Only reads: nothing here writes to MLflow.
"""

from __future__ import annotations

import base64
import json
import os
import sqlite3
import urllib.error
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpmerge.formatting import cut
from dpmerge.privacy_card import CARD_JSON
from dpmerge.registry.errors import (
    TEMPORARY_HTTP_STATUS,
    RegistryError,
    RegistryFailureError,
    RegistryUnavailableError,
)
from dpmerge.registry.filters import search_filter
from dpmerge.registry.tags import (
    PUBLISHED_RECORD_TAG,
    ROLE_CANDIDATE,
    ROLE_MERGED,
    STATUS_READY,
)
from dpmerge.registry.versions import StoredVersion, VersionSummary

ROLES = (ROLE_CANDIDATE, ROLE_MERGED)
SQLITE_BUSY_CODES = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})
"""sqlite's result codes for a database another connection holds: worth retrying."""
REST_TIMEOUT_S = 10.0
DELETED_STAGE = "Deleted_Internal"  # MLflow's SQL store keeps deleted versions with this stage


@dataclass(frozen=True)
class VersionDetail:
    """One version for ``registry show``: its tags, description (a release's privacy card)
    and the aliases naming it."""

    stored: StoredVersion
    description: str
    aliases: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.stored.name,
            "version": self.stored.version,
            "run_id": self.stored.run_id,
            "aliases": list(self.aliases),
            "tags": dict(self.stored.tags),
            "description": self.description,
        }


@dataclass(frozen=True)
class Inventory:
    """Ready candidates by (dataset fingerprint, model family): what a policy can target, and
    the smallest training-set size n their published records state (where one does)."""

    tracking_uri: str
    counts: dict[tuple[str, str], int]
    sizes: dict[tuple[str, str], int] = field(default_factory=dict)

    @property
    def datasets(self) -> list[str]:
        return sorted({dataset for dataset, _ in self.counts})

    @property
    def models(self) -> list[str]:
        return sorted({model for _, model in self.counts})


class Catalog(ABC):
    """The reads (see the module docstring)."""

    def __init__(self, tracking_uri: str) -> None:
        self.tracking_uri = tracking_uri

    @abstractmethod
    def search(self, role: str, name: str | None = None) -> list[StoredVersion]:
        """Versions whose ``dp.role`` tag is ``role`` (of registered model ``name`` if given)."""

    @abstractmethod
    def aliases(self, name: str) -> dict[str, str]:
        """Alias -> version of registered model ``name`` (empty when it does not exist)."""

    @abstractmethod
    def description(self, name: str, version: str) -> str | None:
        """The version's description; ``None`` when the version does not exist."""

    @abstractmethod
    def run_card(self, run_id: str) -> Any:
        """A release run's ``privacy_card.json``, parsed; ``None`` when it cannot be read."""

    def rows(self, name: str | None = None, *, internal: bool = False) -> list[VersionSummary]:
        """The rows of ``registry ls``: every candidate and merged version (of ``name``);
        candidates' accuracies only if ``internal``."""
        found = [v for role in ROLES for v in self.search(role, name)]
        return summaries(found, self.aliases, internal=internal)

    def detail(
        self, name: str | None, version: str | None = None, alias: str | None = None
    ) -> VersionDetail:
        """Version ``version`` of ``name``, or the one ``alias`` names, or the latest. Without
        ``name``, the release model that carries ``alias``."""
        name = name or self.holder(alias or "")
        aliases = self.aliases(name)
        if alias is not None:
            if alias not in aliases:
                known = ", ".join(sorted(aliases)) or "none"
                raise RegistryError(f"{name} has no alias {alias!r} (aliases: {known})")
            version = aliases[alias]
        found = {v.version: v for role in ROLES for v in self.search(role, name)}
        if not found:
            raise RegistryError(f"no dpmerge versions of {name!r} at {self.tracking_uri}")
        version = version or max(found, key=int)
        if version not in found:
            raise RegistryError(
                f"{name} has no version {version} (versions: {', '.join(sorted(found, key=int))})"
            )
        naming = tuple(sorted(a for a, v in aliases.items() if v == version))
        return VersionDetail(found[version], self.description(name, version) or "", naming)

    def holder(self, alias: str) -> str:
        """The one registered model of releases that carries ``alias``."""
        models = {v.name for v in self.search(ROLE_MERGED)}
        holders = sorted(m for m in models if alias in self.aliases(m))
        if len(holders) != 1:
            found = ", ".join(holders) or "none"
            raise RegistryError(
                f"alias {alias!r} is on {len(holders)} release models ({found}); "
                "name the model: MODEL@ALIAS"
            )
        return holders[0]

    def inventory(self) -> Inventory:
        """The ready candidates, counted by dataset fingerprint and model family."""
        counts: dict[tuple[str, str], int] = {}
        sizes: dict[tuple[str, str], int] = {}
        for v in self.search(ROLE_CANDIDATE):
            if v.tags.get("dp.status") == STATUS_READY:
                key = (v.tags.get("dp.dataset", ""), v.tags.get("dp.model", ""))
                counts[key] = counts.get(key, 0) + 1
                size = _dataset_size(v.tags.get(PUBLISHED_RECORD_TAG))
                if size is not None:
                    sizes[key] = min(sizes.get(key, size), size)
        return Inventory(self.tracking_uri, counts, sizes)


def _dataset_size(published: str | None) -> int | None:
    """The ``dataset_size`` of a published record (``None``: none, or not a record)."""
    try:
        record = json.loads(published or "null")
    except ValueError:
        return None
    size = record.get("dataset_size") if isinstance(record, dict) else None
    return size if type(size) is int and size > 0 else None


def summaries(
    found: Iterable[StoredVersion],
    aliases_of: Callable[[str], Mapping[str, str]],
    *,
    internal: bool = False,
) -> list[VersionSummary]:
    """Rows for ``found`` with the aliases naming each version, by name and version; a
    candidate's accuracy only if ``internal`` (docs/design.md#rs-secrecy)."""
    found = list(found)
    naming: dict[str, dict[str, list[str]]] = {}
    for model in {v.name for v in found}:
        for alias, version in aliases_of(model).items():
            naming.setdefault(model, {}).setdefault(str(version), []).append(alias)
    rows = [
        VersionSummary.of(v, naming.get(v.name, {}).get(v.version, []), internal=internal)
        for v in found
    ]
    return sorted(rows, key=lambda r: (r.name, int(r.version)))


class RestCatalog(Catalog):
    """An MLflow server, through its REST API (authentication from ``MLFLOW_TRACKING_TOKEN``
    or ``MLFLOW_TRACKING_USERNAME``/``_PASSWORD``, as MLflow's client reads them)."""

    def _get(
        self, path: str, *, hidden_is_absent: bool = False, **query: str
    ) -> dict[str, Any] | None:
        """The JSON answer; ``None`` for RESOURCE_DOES_NOT_EXIST, and with
        ``hidden_is_absent`` for 403 too: MLflow's auth app answers 403 for a registered model
        the user has no grant on, existing or not (it judges the name before the store is
        asked), so to that user both are "no such model" (docs/stack.md#roles-and-permissions)."""
        body = self._read(f"api/2.0/mlflow/{path}", hidden_is_absent=hidden_is_absent, **query)
        try:
            return None if body is None else json.loads(body or b"{}")
        except ValueError:
            raise RegistryError(f"MLflow server {self.tracking_uri}: {path}: not JSON") from None

    def _read(self, route: str, *, hidden_is_absent: bool = False, **query: str) -> bytes | None:
        """The answer's body to ``GET route?query`` (see :meth:`_get`)."""
        url = f"{self.tracking_uri.rstrip('/')}/{route}"
        request = urllib.request.Request(f"{url}?{urllib.parse.urlencode(query)}")
        for header, value in _auth_headers().items():
            request.add_header(header, value)
        try:
            with urllib.request.urlopen(request, timeout=REST_TIMEOUT_S) as response:
                return response.read()
        except urllib.error.HTTPError as error:
            body = error.read().decode(errors="replace")
            if error.code == 404 and _error_code(body) == "RESOURCE_DOES_NOT_EXIST":
                return None
            if error.code == 403 and hidden_is_absent:
                return None
            message = f"MLflow server {self.tracking_uri}: {route} answered HTTP {error.code}"
            if error.code in TEMPORARY_HTTP_STATUS:
                raise RegistryUnavailableError(message) from None
            kind = RegistryError if error.code < 500 else RegistryFailureError
            raise kind(f"{message}: {cut(body, 200)}") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise RegistryUnavailableError(
                f"MLflow server {self.tracking_uri} unreachable ({reason})"
            ) from None

    def search(self, role: str, name: str | None = None) -> list[StoredVersion]:
        found, token = [], ""
        while True:
            query = {"filter": search_filter(name, {"dp.role": role}), "max_results": "1000"}
            page = self._get(
                "model-versions/search", **query, **({"page_token": token} if token else {})
            )
            for mv in (page or {}).get("model_versions", []):
                tags = {t["key"]: t.get("value", "") for t in mv.get("tags", [])}
                found.append(StoredVersion(mv["name"], str(mv["version"]), mv.get("run_id"), tags))
            token = (page or {}).get("next_page_token", "")
            if not token:
                return found

    def aliases(self, name: str) -> dict[str, str]:
        answer = self._get("registered-models/get", hidden_is_absent=True, name=name)
        model = (answer or {}).get("registered_model", {})
        return {a["alias"]: str(a["version"]) for a in model.get("aliases", [])}

    def description(self, name: str, version: str) -> str | None:
        found = self._get("model-versions/get", name=name, version=version)
        return None if found is None else found.get("model_version", {}).get("description", "")

    def run_card(self, run_id: str) -> Any:
        body = self._read("get-artifact", hidden_is_absent=True, path=CARD_JSON, run_uuid=run_id)
        return _parsed(body)  # a user who may not read the run reads no card: not checked


def _parsed(body: bytes | None) -> Any:
    """JSON ``body``, ``None`` when there is none or it is not JSON."""
    try:
        return None if body is None else json.loads(body)
    except ValueError:
        return None


def _error_code(body: str) -> str | None:
    """The ``error_code`` of MLflow's JSON error answer, ``None`` when the body is not one."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    return document.get("error_code") if isinstance(document, dict) else None


def _auth_headers() -> dict[str, str]:
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        return {"Authorization": f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"}
    user, password = (
        os.environ.get("MLFLOW_TRACKING_USERNAME"),
        os.environ.get("MLFLOW_TRACKING_PASSWORD"),
    )
    if user and password:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        return {"Authorization": f"Basic {token}"}
    return {}


class SqliteCatalog(Catalog):
    """An embedded MLflow database, read-only (MLflow's ``model_versions``,
    ``model_version_tags`` and ``registered_model_aliases`` tables)."""

    def __init__(self, tracking_uri: str) -> None:
        super().__init__(tracking_uri)
        self.path = Path(tracking_uri.removeprefix("sqlite:///"))
        if not self.path.is_file():
            raise RegistryError(f"no MLflow database at {self.path}")

    def _query(self, sql: str, *params: str) -> list[tuple[Any, ...]]:
        try:
            with sqlite3.connect(f"{self.path.absolute().as_uri()}?mode=ro", uri=True) as db:
                return db.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as error:
            code = getattr(error, "sqlite_errorcode", None)
            if code is not None and code & 0xFF in SQLITE_BUSY_CODES:  # an extended code's primary
                raise RegistryUnavailableError(f"{self.path}: {error}") from None
            raise RegistryError(f"{self.path} is not an MLflow database ({error})") from None

    def search(self, role: str, name: str | None = None) -> list[StoredVersion]:
        rows = self._query(
            "SELECT mv.name, mv.version, mv.run_id, t.key, t.value FROM model_versions mv "
            "JOIN model_version_tags t ON t.name = mv.name AND t.version = mv.version "
            "WHERE mv.current_stage != ? AND EXISTS (SELECT 1 FROM model_version_tags r "
            "WHERE r.name = mv.name AND r.version = mv.version AND r.key = 'dp.role' "
            "AND r.value = ?)" + (" AND mv.name = ?" if name else ""),
            DELETED_STAGE,
            role,
            *([name] if name else []),
        )
        grouped: dict[tuple[str, str], StoredVersion] = {}
        for model, version, run_id, key, value in rows:
            entry = grouped.setdefault(
                (model, str(version)), StoredVersion(model, str(version), run_id, {})
            )
            entry.tags[key] = value
        return list(grouped.values())

    def aliases(self, name: str) -> dict[str, str]:
        rows = self._query(
            "SELECT alias, version FROM registered_model_aliases WHERE name = ?", name
        )
        return {alias: str(version) for alias, version in rows}

    def description(self, name: str, version: str) -> str | None:
        rows = self._query(
            "SELECT description FROM model_versions WHERE name = ? AND version = ? "
            "AND current_stage != ?",
            name,
            version,
            DELETED_STAGE,
        )
        return (rows[0][0] or "") if rows else None

    def run_card(self, run_id: str) -> Any:
        rows = self._query("SELECT artifact_uri FROM runs WHERE run_uuid = ?", run_id)
        location = urllib.parse.urlparse(rows[0][0] if rows else "")
        if location.scheme not in ("", "file"):
            return None
        try:
            return _parsed((Path(urllib.parse.unquote(location.path)) / CARD_JSON).read_bytes())
        except OSError:
            return None


class ClientCatalog(Catalog):
    """Any other tracking URI: the registry's own MLflow client (slower to start)."""

    def __init__(self, tracking_uri: str) -> None:
        super().__init__(tracking_uri)
        from dpmerge.registry.queries import RegistryQueries

        self._queries = RegistryQueries(tracking_uri, "dpmerge-registry", None)

    def search(self, role: str, name: str | None = None) -> list[StoredVersion]:
        return self._queries._search(search_filter(name, {"dp.role": role}))

    def aliases(self, name: str) -> dict[str, str]:
        return self._queries.aliases(name) if self._queries.model_exists(name) else {}

    def description(self, name: str, version: str) -> str | None:
        try:
            return self._queries.card_text(name, version)
        except RegistryError:
            return None

    def run_card(self, run_id: str) -> Any:
        try:
            return self._queries._run_json(run_id, CARD_JSON)
        except RegistryError:
            return None


def open_catalog(tracking_uri: str) -> Catalog:
    """The catalog for ``tracking_uri`` (see the module docstring)."""
    if tracking_uri.startswith(("http://", "https://")):
        return RestCatalog(tracking_uri)
    if tracking_uri.startswith("sqlite:///"):
        return SqliteCatalog(tracking_uri)
    return ClientCatalog(tracking_uri)
