"""Where a policy merge reads and writes: the local home, the tracking URI, S3; scratch
directories."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpmerge.errors import AccessError
from dpmerge.home import DEFAULT_HOME, HOME_ENV, resolve_home
from dpmerge.keys import KEY_ENV, KEY_FILE_ENV, WorkflowKey
from dpmerge.locate import Located, command, embedded_tracking_uri, is_stack_registry
from dpmerge.state import LocalBackend, S3Backend, StateStore
from dpmerge.storage import S3Config, S3Store

if TYPE_CHECKING:
    from dpmerge.registry import Registry

__all__ = [
    "DEFAULT_HOME",
    "HOME_ENV",
    "Workspace",
    "embedded_tracking_uri",
    "remove_tree",
    "resolve_home",
]


@dataclass(frozen=True)
class Workspace:
    """Where a policy merge reads and writes.

    ``tracking_uri``: ``$MLFLOW_TRACKING_URI``, else the embedded ``<home>/mlflow.db`` (artifacts
    in ``<home>/mlartifacts``). ``s3``: set when ``DPMERGE_S3_ENDPOINT_URL`` or
    ``DPMERGE_S3_BUCKET`` is (the local stack sets both): audit records then go to the audit
    bucket and the release ledger to ``s3://<bucket>/ledger/releases.json``; otherwise both stay
    under ``home`` (audit records 0600 in a 0700 directory).
    """

    tracking_uri: str
    home: Path
    s3: S3Config | None = None

    @classmethod
    def from_env(cls, home: str | Path | None = None) -> Workspace:
        home_path = resolve_home(home)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or embedded_tracking_uri(home_path)
        use_s3 = os.environ.get("DPMERGE_S3_ENDPOINT_URL") or os.environ.get("DPMERGE_S3_BUCKET")
        return cls(uri, home_path, S3Config.from_env() if use_s3 else None)

    @classmethod
    def of_registry(cls, tracking_uri: str, home: str | Path | None = None) -> Workspace:
        """The workspace of the registry at ``tracking_uri`` (as :mod:`dpmerge.locate` found
        it): an embedded ``sqlite:///…/mlflow.db`` keeps its state beside its database;
        another registry uses the environment's state store (S3, else ``home``)."""
        if tracking_uri.startswith("sqlite:///"):
            database = Path(tracking_uri.removeprefix("sqlite:///"))
            return cls(tracking_uri, database.absolute().parent, None)
        base = cls.from_env(home)
        return cls(tracking_uri, base.home, base.s3)

    def workflow_key(self) -> WorkflowKey | None:
        """The workflow's secret key (docs/design.md#security): ``$DPMERGE_SECRET_KEY`` or
        ``$DPMERGE_SECRET_KEY_FILE``; embedded (no S3), else ``<home>/secret.key``, generated on
        first use. On a stack the key reaches only the workflow's processes, through their
        environment: a shell without it (an operator's) gets ``None`` and never a local key."""
        named = os.environ.get(KEY_ENV) or os.environ.get(KEY_FILE_ENV)
        if named or (self.s3 is None and not self.stack_without_state):
            return WorkflowKey.from_env(self.home)
        return None

    @property
    def stack_without_state(self) -> bool:
        """The local stack's registry, in an environment with no S3 settings (a consumer's):
        its release state is in the stack's S3, out of this role's reach, and a local home
        must not stand in for it."""
        return self.s3 is None and is_stack_registry(self.tracking_uri)

    def located(self) -> Located:
        """The registry this workspace uses, named as every command names it
        (:meth:`dpmerge.locate.Located.describe`)."""
        from_env = os.environ.get("MLFLOW_TRACKING_URI") == self.tracking_uri
        source = "$MLFLOW_TRACKING_URI" if from_env else f"the embedded state ({self.home})"
        return Located.at(self.tracking_uri, source)

    def registry(self) -> Registry:
        """The registry, with the workflow's secret key where this process has it; without
        it (an operator's shell) signatures are verified with the release public key
        (``$DPMERGE_RELEASE_PUBLIC_KEY``) and nothing can be signed. (Imported here: MLflow and
        torch stay out of commands that only read the state, such as ``registry ls``.)"""
        from dpmerge.registry import Registry

        if self.tracking_uri.startswith("sqlite:///"):
            self.home.mkdir(parents=True, exist_ok=True)
        key = self.workflow_key()
        return Registry(self.tracking_uri, keys=key, public_key=None if key else "")

    def store(self) -> S3Store | None:
        return S3Store(self.s3) if self.s3 is not None else None

    def state(self) -> StateStore:
        """The release-state store: the stack's state bucket, else ``<home>/state``; on the
        stack's registry without S3 settings, :class:`~dpmerge.errors.AccessError`."""
        if self.stack_without_state:
            raise AccessError(
                f"this environment has no access to the stack's release-state store (S3): the "
                f"command needs the workflow's or an operator's environment "
                f"(`{command('stack', 'env', '--role', 'operator')}`)"
            )
        store = self.store()
        backend = S3Backend(store) if store is not None else LocalBackend(self.home / "state")
        return StateStore(backend, self.workflow_key())

    def private_dir(self, name: str) -> Path:
        path = self.home / name
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.chmod(0o700)
        return path

    @property
    def cache_dir(self) -> Path:
        """Derived, rebuildable data (evaluation splits)."""
        return self.home / "cache"

    def use_caches(self) -> None:
        """Keep candidates' PLDs under ``cache_dir`` across processes (each flow run is a new
        process; rebuilding five fine PLDs costs seconds of every time-to-policy). The directory
        is private (0700): certified ε values are computed from what it holds."""
        from dpmerge.accounting import pld

        self.private_dir("cache")
        pld.set_disk_cache(self.cache_dir / "pld")

    def scratch(self) -> Path:
        """A new private (0700) working directory the caller removes."""
        return Path(tempfile.mkdtemp(prefix="dpmerge-policy-", dir=self.private_dir("work")))

    def to_dict(self) -> dict[str, Any]:
        return {
            "tracking_uri": self.tracking_uri,
            "home": str(self.home),
            "s3_endpoint": self.s3.endpoint_url if self.s3 else None,
            "s3_bucket": self.s3.bucket if self.s3 else None,
        }


def remove_tree(path: str | Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
