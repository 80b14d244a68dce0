"""The project's own objects in S3 (boto3): buckets, the release ledger, audit records.

Three buckets. The **project bucket** (default ``dpmerge``) holds the MLflow artifact store
(prefix ``mlartifacts/``, written by the MLflow server) and the release ledger. The **state
bucket** (default ``dpmerge-state``, restricted and versioned like the audit bucket) is the
release-state store: policies, ledger, serving pointers, quarantine, release records, leases.
The **audit bucket** (default ``dpmerge-audit``) holds access-restricted records such as the
secret RS draw (docs/design.md#random-selection): it is created with public access blocked,
default encryption and versioning, and an audit record is written at most once (a conditional
``If-None-Match: *`` put), so a release cannot be re-drawn by overwriting its record. Nothing
from the audit bucket goes to MLflow tags or privacy cards.

Configuration comes from the environment (:meth:`S3Config.from_env`); credentials follow the
usual AWS chain unless given explicitly (the local stack passes its own). Transient
errors are retried by botocore (``standard`` mode); what still fails raises
:class:`StorageError` with a one-line cause — :class:`StorageUnavailableError` (a
:class:`~dpmerge.errors.TransientError`, worth retrying later) when botocore's exception type,
the error code or the HTTP status says the failure is temporary (an unreachable endpoint, a
timeout, throttling, a 5xx), :class:`ObjectNotFoundError` for a missing bucket or key.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from dpmerge.errors import DPMergeError, TransientError
from dpmerge.locate import command

DEFAULT_BUCKET = "dpmerge"
DEFAULT_AUDIT_BUCKET = "dpmerge-audit"
DEFAULT_STATE_BUCKET = "dpmerge-state"
DEFAULT_REGION = "us-east-1"
MLFLOW_ARTIFACTS_PREFIX = "mlartifacts"
AUDIT_PREFIX = "releases"

_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SSE_RULE = {"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}
_NOT_FOUND = {"404", "NoSuchKey", "NoSuchBucket", "NotFound"}
_TEMPORARY_CODES = {
    "RequestTimeout",
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "ServiceUnavailable",
    "InternalError",
}
"""S3 error codes of a temporary failure (besides any 429 or 5xx status)."""


class StorageError(DPMergeError):
    """An S3 operation failed; the message names the endpoint, bucket and key."""


class StorageUnavailableError(StorageError, TransientError):
    """The endpoint is unreachable, timed out, throttled or failed with a 5xx: worth retrying."""


class ObjectNotFoundError(StorageError):
    """The bucket or key does not exist."""


class ObjectExistsError(StorageError):
    """A create-only write found the key already there."""


class ObjectChangedError(StorageError):
    """A conditional write (``If-Match``) found the object changed or gone since it was read."""


@dataclass(frozen=True)
class S3Config:
    """Where the project's objects live. ``endpoint_url=None`` means AWS itself."""

    endpoint_url: str | None = None
    bucket: str = DEFAULT_BUCKET
    audit_bucket: str = DEFAULT_AUDIT_BUCKET
    state_bucket: str = DEFAULT_STATE_BUCKET
    """The release-state store (docs/design.md#release-state): policies, the ledger, serving
    pointers, quarantine, leases; versioned, written only create-once or compare-and-swap."""
    region: str = DEFAULT_REGION
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    max_attempts: int = 5
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    block_public_access: bool = True
    """``False`` only for a server without the PublicAccessBlock API that refuses anonymous
    requests anyway (the local stack's SeaweedFS, docs/stack.md)."""

    def __post_init__(self) -> None:
        names = (self.bucket, self.audit_bucket, self.state_bucket)
        for name in names:
            if not _BUCKET_NAME.match(name):
                raise StorageError(f"invalid S3 bucket name {name!r} (3–63 of a-z 0-9 . -)")
        if len(set(names)) != len(names):
            raise StorageError(
                f"the project, audit and state buckets must differ ({', '.join(names)}): "
                "each has its own access rules"
            )
        if self.max_attempts < 1:
            raise StorageError(f"max_attempts must be at least 1, got {self.max_attempts}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> S3Config:
        """Read ``DPMERGE_S3_ENDPOINT_URL`` (else ``MLFLOW_S3_ENDPOINT_URL``),
        ``DPMERGE_S3_BUCKET``, ``DPMERGE_S3_AUDIT_BUCKET``, ``DPMERGE_S3_STATE_BUCKET``,
        ``DPMERGE_S3_MAX_ATTEMPTS`` and
        ``AWS_REGION``/``AWS_DEFAULT_REGION``; credentials are left to the AWS chain."""
        env = os.environ if environ is None else environ
        endpoint = env.get("DPMERGE_S3_ENDPOINT_URL") or env.get("MLFLOW_S3_ENDPOINT_URL")
        attempts = env.get("DPMERGE_S3_MAX_ATTEMPTS", "5")
        try:
            max_attempts = int(attempts)
        except ValueError:
            raise StorageError(
                f"DPMERGE_S3_MAX_ATTEMPTS must be an integer, got {attempts!r}"
            ) from None
        return cls(
            endpoint_url=endpoint or None,
            bucket=env.get("DPMERGE_S3_BUCKET", DEFAULT_BUCKET),
            audit_bucket=env.get("DPMERGE_S3_AUDIT_BUCKET", DEFAULT_AUDIT_BUCKET),
            state_bucket=env.get("DPMERGE_S3_STATE_BUCKET", DEFAULT_STATE_BUCKET),
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or DEFAULT_REGION,
            max_attempts=max_attempts,
        )

    @property
    def mlflow_artifacts_uri(self) -> str:
        """The MLflow server's ``--artifacts-destination``."""
        return f"s3://{self.bucket}/{MLFLOW_ARTIFACTS_PREFIX}"

    @property
    def where(self) -> str:
        return self.endpoint_url or f"AWS S3 ({self.region})"


_CLIENTS: dict[S3Config, Any] = {}
_CLIENTS_LOCK = threading.Lock()
_SESSION: list[boto3.session.Session] = []  # the process's one session, made on first use


def _session() -> boto3.session.Session:
    """The process's boto3 session (call under the lock): its clients share botocore's loaded
    service models, so every client after the first is made in milliseconds."""
    if not _SESSION:
        _SESSION.append(boto3.session.Session())
    return _SESSION[0]


def _client(cfg: S3Config) -> Any:
    """The process's boto3 client for ``cfg``, made once: making one reads botocore's service
    models (≈ 0.1–0.3 s), which every policy run paid a dozen times. boto3 clients are
    thread-safe once made; making one (and the session) is not, hence the lock."""
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(cfg)
        if client is None:
            client = _CLIENTS[cfg] = _session().client(
                "s3",
                endpoint_url=cfg.endpoint_url,
                region_name=cfg.region,
                aws_access_key_id=cfg.access_key_id,
                aws_secret_access_key=cfg.secret_access_key,
                config=Config(
                    retries={"max_attempts": cfg.max_attempts, "mode": "standard"},
                    connect_timeout=cfg.connect_timeout_s,
                    read_timeout=cfg.read_timeout_s,
                    s3={"addressing_style": "path"},
                ),
            )
        return client


def prepare_process() -> None:
    """Load botocore's S3 service model into the process's session before the warm flow-run
    server forks (flows/warm.py), so a run's first S3 client is made in milliseconds. Makes a
    client that is never used: no request, no connection, no thread."""
    with _CLIENTS_LOCK:
        _session().client(
            "s3",
            region_name=DEFAULT_REGION,
            endpoint_url="http://127.0.0.1:1",
            aws_access_key_id="unused",
            aws_secret_access_key="unused",
        )


class S3Store:
    """put/get/list/delete for the project's objects; one boto3 client per configuration and
    process, shared by its stores."""

    def __init__(self, config: S3Config | None = None) -> None:
        self.config = config or S3Config.from_env()
        self.client = _client(self.config)

    @contextmanager
    def _errors(self, action: str, bucket: str, key: str | None = None) -> Iterator[None]:
        target = f"s3://{bucket}/{key}" if key is not None else f"s3://{bucket}"
        try:
            yield
        except BotoConnectionError as error:
            raise StorageUnavailableError(
                f"S3 endpoint {self.config.where} unreachable while {action} {target} "
                f"({type(error).__name__}); start the local stack (`{command('stack', 'up')}`) "
                "or set DPMERGE_S3_ENDPOINT_URL"
            ) from None
        except NoCredentialsError:
            raise StorageError(
                f"no AWS credentials for {self.config.where} while {action} {target}; set "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (local stack: "
                f'eval "$({command("stack", "env")})")'
            ) from None
        except ClientError as error:
            code = str(error.response.get("Error", {}).get("Code", ""))
            message = error.response.get("Error", {}).get("Message", "")
            if code in _NOT_FOUND:
                raise ObjectNotFoundError(f"not found while {action}: {target} ({code})") from None
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            temporary = code in _TEMPORARY_CODES or status == 429 or (status or 0) >= 500
            kind = StorageUnavailableError if temporary else StorageError
            raise kind(f"S3 error while {action} {target}: {code} {message}") from None
        except (HTTPClientError, IncompleteReadError) as error:  # timeouts, dropped connections
            raise StorageUnavailableError(
                f"S3 endpoint {self.config.where} failed while {action} {target}: {error}"
            ) from None
        except BotoCoreError as error:
            raise StorageError(f"S3 error while {action} {target}: {error}") from None

    # --- buckets -------------------------------------------------------------------------

    def ensure_bucket(self, bucket: str | None = None, *, restricted: bool = False) -> str:
        """Create ``bucket`` (default: the project bucket) if missing. ``restricted`` blocks
        public access (where the server has that API: ``block_public_access``) and turns on
        default encryption and versioning (the audit bucket)."""
        bucket = bucket or self.config.bucket
        with self._errors("checking bucket", bucket):
            try:
                self.client.head_bucket(Bucket=bucket)
                exists = True
            except ClientError as error:
                if str(error.response.get("Error", {}).get("Code")) not in _NOT_FOUND:
                    raise
                exists = False
        if not exists:
            with self._errors("creating bucket", bucket):
                extra = (
                    {}
                    if self.config.region == "us-east-1"
                    else {"CreateBucketConfiguration": {"LocationConstraint": self.config.region}}
                )
                self.client.create_bucket(Bucket=bucket, **extra)
        if restricted:
            with self._errors("restricting bucket", bucket):
                if self.config.block_public_access:
                    self.client.put_public_access_block(
                        Bucket=bucket,
                        PublicAccessBlockConfiguration={
                            "BlockPublicAcls": True,
                            "IgnorePublicAcls": True,
                            "BlockPublicPolicy": True,
                            "RestrictPublicBuckets": True,
                        },
                    )
                self.client.put_bucket_encryption(
                    Bucket=bucket,
                    ServerSideEncryptionConfiguration={"Rules": [_SSE_RULE]},
                )
                self.client.put_bucket_versioning(
                    Bucket=bucket, VersioningConfiguration={"Status": "Enabled"}
                )
        return bucket

    def bootstrap(self) -> None:
        """Create the project bucket and the restricted audit and state buckets (idempotent)."""
        self.ensure_bucket(self.config.bucket)
        self.ensure_bucket(self.config.audit_bucket, restricted=True)
        self.ensure_bucket(self.config.state_bucket, restricted=True)

    # --- objects -------------------------------------------------------------------------

    def put_bytes(
        self,
        key: str,
        data: bytes,
        *,
        bucket: str | None = None,
        if_absent: bool = False,
        if_match: str | None = None,
        content_type: str = "application/octet-stream",
    ) -> str:
        """Write one object; with ``if_absent`` refuse to replace an existing one
        (:class:`ObjectExistsError`), with ``if_match`` replace only the version with that ETag
        (:class:`ObjectChangedError`: another writer came first). Returns its ``s3://`` URI."""
        bucket = bucket or self.config.bucket
        if if_absent and if_match is not None:
            raise StorageError("a write is either create-only or conditional on an ETag")
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if if_absent else {}
        if if_match is not None:
            extra["IfMatch"] = if_match
        with self._errors("writing", bucket, key):
            try:
                self.client.put_object(
                    Bucket=bucket, Key=key, Body=data, ContentType=content_type, **extra
                )
            except ClientError as error:
                code = str(error.response.get("Error", {}).get("Code"))
                if if_match is not None and code in {"PreconditionFailed", *_NOT_FOUND}:
                    raise ObjectChangedError(
                        f"s3://{bucket}/{key} changed since it was read"
                    ) from None
                if code == "PreconditionFailed":
                    raise ObjectExistsError(f"s3://{bucket}/{key} already exists") from None
                raise
        return f"s3://{bucket}/{key}"

    def put_json(
        self, key: str, document: Any, *, bucket: str | None = None, if_absent: bool = False
    ) -> str:
        data = json.dumps(document, indent=2, sort_keys=True).encode()
        return self.put_bytes(
            key, data, bucket=bucket, if_absent=if_absent, content_type="application/json"
        )

    def get_bytes(self, key: str, *, bucket: str | None = None) -> bytes:
        bucket = bucket or self.config.bucket
        with self._errors("reading", bucket, key):
            return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()

    def get_versioned(
        self, key: str, *, bucket: str | None = None, limit: int | None = None
    ) -> tuple[bytes, str] | None:
        """An object's bytes (at most its first ``limit``) and ETag (for a later
        ``put_bytes(if_match=…)``), or ``None`` when it does not exist."""
        bucket = bucket or self.config.bucket
        try:
            with self._errors("reading", bucket, key):
                response = self.client.get_object(Bucket=bucket, Key=key)
                with closing(response["Body"]) as body:
                    data = body.read() if limit is None else body.read(limit)
                return data, str(response["ETag"])
        except ObjectNotFoundError:
            return None

    def get_json(self, key: str, *, bucket: str | None = None) -> Any:
        return json.loads(self.get_bytes(key, bucket=bucket))

    def exists(self, key: str, *, bucket: str | None = None) -> bool:
        bucket = bucket or self.config.bucket
        try:
            with self._errors("checking", bucket, key):
                self.client.head_object(Bucket=bucket, Key=key)
        except ObjectNotFoundError:
            return False
        return True

    def list_keys(self, prefix: str = "", *, bucket: str | None = None) -> list[str]:
        """Every key under ``prefix``, sorted."""
        bucket = bucket or self.config.bucket
        keys: list[str] = []
        with self._errors("listing", bucket, prefix):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix
            ):
                keys.extend(item["Key"] for item in page.get("Contents", []))
        return sorted(keys)

    def versions(self, key: str, *, bucket: str | None = None) -> list[str]:
        """The version ids of ``key`` in a versioned bucket, newest first (none: ``[]``), in
        the order S3 lists them (newest first; timestamps have only second resolution)."""
        bucket = bucket or self.config.bucket
        found: list[tuple[bool, str]] = []
        with self._errors("listing versions of", bucket, key):
            for page in self.client.get_paginator("list_object_versions").paginate(
                Bucket=bucket, Prefix=key
            ):
                found += [
                    (bool(item.get("IsLatest")), str(item["VersionId"]))
                    for item in page.get("Versions", [])
                    if item["Key"] == key
                ]
        return [version for latest, version in found if latest] + [
            version for latest, version in found if not latest
        ]

    def get_version(self, key: str, version_id: str, *, bucket: str | None = None) -> bytes:
        """The bytes of one earlier version of ``key`` (see :meth:`versions`)."""
        bucket = bucket or self.config.bucket
        with self._errors("reading a version of", bucket, key):
            return self.client.get_object(Bucket=bucket, Key=key, VersionId=version_id)[
                "Body"
            ].read()

    def delete(self, key: str, *, bucket: str | None = None) -> None:
        bucket = bucket or self.config.bucket
        with self._errors("deleting", bucket, key):
            self.client.delete_object(Bucket=bucket, Key=key)

    # --- project objects -----------------------------------------------------------------

    def write_audit_record(self, release_id: str, record: Mapping[str, Any]) -> str:
        """Store an access-restricted audit record (e.g. the RS draw) for one release in the
        audit bucket, at most once: a second write for the same release is refused, since
        drawing again for a release is a selection step that costs privacy
        (docs/design.md#random-selection)."""
        key = f"{AUDIT_PREFIX}/{_segment(release_id)}.json"
        try:
            return self.put_json(key, dict(record), bucket=self.config.audit_bucket, if_absent=True)
        except ObjectExistsError:
            raise ObjectExistsError(
                f"an audit record for release {release_id!r} already exists; "
                "one draw per release (docs/design.md#random-selection)"
            ) from None

    def read_audit_record(self, release_id: str) -> dict[str, Any]:
        key = f"{AUDIT_PREFIX}/{_segment(release_id)}.json"
        return self.get_json(key, bucket=self.config.audit_bucket)


def _segment(name: str) -> str:
    """A key segment: no slashes, no leading dots, not empty."""
    if not name or "/" in name or name.startswith(".") or not name.isprintable():
        raise StorageError(f"invalid key segment {name!r}")
    return name
