"""S3 storage against the local stack's S3 server on loopback (and configuration without one)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import boto3
import pytest
from botocore.exceptions import ClientError
from botocore.stub import Stubber

from devstack import free_ports
from dpmerge.errors import is_transient
from dpmerge.storage import (
    ObjectChangedError,
    ObjectExistsError,
    ObjectNotFoundError,
    S3Config,
    S3Store,
    StorageError,
    StorageUnavailableError,
)


def test_config_from_env_prefers_dpmerge_endpoint() -> None:
    env = {
        "MLFLOW_S3_ENDPOINT_URL": "http://127.0.0.1:1",
        "DPMERGE_S3_ENDPOINT_URL": "http://127.0.0.1:2",
        "DPMERGE_S3_BUCKET": "proj",
        "DPMERGE_S3_STATE_BUCKET": "proj-state",
        "AWS_DEFAULT_REGION": "eu-west-1",
    }
    config = S3Config.from_env(env)
    assert config.endpoint_url == "http://127.0.0.1:2"
    assert (config.bucket, config.audit_bucket, config.state_bucket, config.region) == (
        "proj",
        "dpmerge-audit",
        "proj-state",
        "eu-west-1",
    )
    assert S3Config.from_env({}).state_bucket == "dpmerge-state"
    assert config.mlflow_artifacts_uri == "s3://proj/mlartifacts"
    assert S3Config.from_env({"MLFLOW_S3_ENDPOINT_URL": "http://x:1"}).endpoint_url == "http://x:1"
    assert S3Config.from_env({}).endpoint_url is None


def test_config_rejects_bad_buckets() -> None:
    with pytest.raises(StorageError, match="invalid S3 bucket name"):
        S3Config(bucket="No_Such")
    with pytest.raises(StorageError, match="must differ"):
        S3Config(bucket="same", audit_bucket="same")
    with pytest.raises(StorageError, match="must differ"):
        S3Config(audit_bucket="same", state_bucket="same")
    with pytest.raises(StorageError, match="integer"):
        S3Config.from_env({"DPMERGE_S3_MAX_ATTEMPTS": "many"})


def test_unreachable_endpoint_is_a_clear_error() -> None:
    (port,) = free_ports(1)  # nothing listens there
    store = S3Store(
        S3Config(
            endpoint_url=f"http://127.0.0.1:{port}",
            access_key_id="x",
            secret_access_key="x",
            max_attempts=1,
        )
    )
    start = time.monotonic()
    with pytest.raises(
        StorageUnavailableError, match=rf"127\.0\.0\.1:{port} unreachable.*dpmerge stack up"
    ) as down:
        store.get_bytes("anything")
    assert time.monotonic() - start < 10
    assert is_transient(down.value)


def test_s3_failures_are_transient_by_code_or_status() -> None:
    """Throttling and 5xx answers are transient (worth retrying), a refusal or a missing key is
    not; decided by the error code and HTTP status S3 sent, not by any text."""
    store = S3Store(
        S3Config(endpoint_url="http://127.0.0.1:9", access_key_id="x", secret_access_key="x")
    )
    answers = [
        ("SlowDown", 503, StorageUnavailableError),
        ("InternalError", 500, StorageUnavailableError),
        ("SomethingNew", 502, StorageUnavailableError),
        ("TooManyRequests", 429, StorageUnavailableError),
        ("AccessDenied", 403, StorageError),
        ("NoSuchKey", 404, ObjectNotFoundError),
    ]
    with Stubber(store.client) as s3:
        for code, status, _ in answers:
            s3.add_client_error("get_object", service_error_code=code, http_status_code=status)
        for code, status, kind in answers:
            with pytest.raises(StorageError, match=code) as failed:
                store.get_bytes("key")
            assert type(failed.value) is kind, (code, status)
            assert is_transient(failed.value) == (kind is StorageUnavailableError), code


def test_restricted_bucket_blocks_public_access_unless_the_server_has_no_such_api() -> None:
    """Against AWS (the default) the audit bucket gets a public access block; the local
    stack's server has no such API and refuses anonymous requests instead (next test)."""
    for block in (True, False):
        store = S3Store(
            S3Config(
                endpoint_url="http://127.0.0.1:1",
                access_key_id="x",
                secret_access_key="x",
                block_public_access=block,
            )
        )
        with Stubber(store.client) as stub:
            stub.add_response("head_bucket", {}, {"Bucket": "dpmerge-audit"})
            if block:
                stub.add_response("put_public_access_block", {})
            stub.add_response("put_bucket_encryption", {})
            stub.add_response("put_bucket_versioning", {})
            store.ensure_bucket("dpmerge-audit", restricted=True)
            stub.assert_no_pending_responses()


@pytest.mark.integration
def test_bootstrap_restricts_the_audit_and_state_buckets(s3_store: S3Store) -> None:
    s3_store.bootstrap()  # idempotent: the stack already ran it
    client, config = s3_store.client, s3_store.config
    names = {b["Name"] for b in client.list_buckets()["Buckets"]}
    assert {config.bucket, config.audit_bucket, config.state_bucket} <= names
    stranger = boto3.client(
        "s3",
        endpoint_url=config.endpoint_url,
        aws_access_key_id="stranger",
        aws_secret_access_key="stranger",
        region_name=config.region,
    )
    with pytest.raises(ClientError, match="InvalidAccessKeyId"):
        stranger.list_objects_v2(Bucket=config.audit_bucket)
    request = urllib.request.Request(f"{config.endpoint_url}/{config.audit_bucket}")
    with pytest.raises(urllib.error.HTTPError, match="403"):
        urllib.request.urlopen(request, timeout=10)  # anonymous
    rules = client.get_bucket_encryption(Bucket=config.audit_bucket)
    assert (
        rules["ServerSideEncryptionConfiguration"]["Rules"][0][
            "ApplyServerSideEncryptionByDefault"
        ]["SSEAlgorithm"]
        == "AES256"
    )
    for restricted in (config.audit_bucket, config.state_bucket):
        assert client.get_bucket_versioning(Bucket=restricted)["Status"] == "Enabled"
        rule = client.get_bucket_encryption(Bucket=restricted)["ServerSideEncryptionConfiguration"]
        assert rule["Rules"][0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"


@pytest.mark.integration
def test_objects_round_trip(s3_store: S3Store) -> None:
    uri = s3_store.put_json("exports/t1/doc.json", {"b": 1, "a": [1, 2]})
    assert uri == f"s3://{s3_store.config.bucket}/exports/t1/doc.json"
    assert s3_store.get_json("exports/t1/doc.json") == {"a": [1, 2], "b": 1}
    s3_store.put_bytes("exports/t1/raw.bin", b"\x00\x01")
    assert s3_store.exists("exports/t1/raw.bin") and not s3_store.exists("exports/t1/none")
    assert s3_store.list_keys("exports/t1/") == ["exports/t1/doc.json", "exports/t1/raw.bin"]
    s3_store.delete("exports/t1/raw.bin")
    with pytest.raises(ObjectNotFoundError):
        s3_store.get_bytes("exports/t1/raw.bin")
    s3_store.delete("exports/t1/doc.json")
    assert s3_store.list_keys("exports/t1/") == []
    s3_store.put_bytes("exports/t2", b"1")
    with pytest.raises(ObjectExistsError):
        s3_store.put_bytes("exports/t2", b"2", if_absent=True)
    assert s3_store.get_bytes("exports/t2") == b"1"
    with pytest.raises(ObjectNotFoundError, match="NoSuchBucket"):
        s3_store.get_bytes("k", bucket="no-such-bucket")


@pytest.mark.integration
def test_audit_record_is_written_once_in_the_audit_bucket(s3_store: S3Store) -> None:
    record = {"drawn_index": 2, "probabilities": [0.2, 0.3, 0.5]}
    uri = s3_store.write_audit_record("release-abc", record)
    assert uri.startswith(f"s3://{s3_store.config.audit_bucket}/")
    assert s3_store.read_audit_record("release-abc") == record
    with pytest.raises(ObjectExistsError, match="one draw per release"):
        s3_store.write_audit_record("release-abc", {"drawn_index": 0})
    assert s3_store.read_audit_record("release-abc") == record
    assert not [k for k in s3_store.list_keys("") if "release-abc" in k]  # project bucket


@pytest.mark.integration
def test_conditional_writes_detect_another_writer(s3_store: S3Store) -> None:
    assert s3_store.get_versioned("exports/cond/none") is None
    s3_store.put_bytes("exports/cond/doc", b"1", if_absent=True)
    data, etag = s3_store.get_versioned("exports/cond/doc")
    assert data == b"1"
    s3_store.put_bytes("exports/cond/doc", b"2", if_match=etag)  # nobody wrote in between
    with pytest.raises(ObjectChangedError, match="changed since it was read"):
        s3_store.put_bytes("exports/cond/doc", b"3", if_match=etag)  # the ETag is stale now
    with pytest.raises(ObjectChangedError):
        s3_store.put_bytes("exports/cond/gone", b"1", if_match=etag)
    with pytest.raises(StorageError, match="either create-only"):
        s3_store.put_bytes("exports/cond/doc", b"4", if_absent=True, if_match=etag)
    assert s3_store.get_bytes("exports/cond/doc") == b"2"
