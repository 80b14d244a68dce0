"""The workflow on the real local stack (S3, MLflow on S3, Prefect server, cpu/gpu
workers polling every second): deploy deployments/prefect.yaml, train candidates through the
``gpu`` pool, then drive ``merge-on-policy`` with ``dpmerge.policy.updated`` events.

The Prefect server runs with a 1 s concurrency-slot requeue wait (default 30 s) so the
serialised second run starts promptly."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from deployed import deployed_stack
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

import devstack as stack_mod
from dpmerge.policies import policy_from_dict
from flows import runtime

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
DELTA = 1e-5
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack_mod.StackConfig]:
    """The stack with the deployments applied; afterwards nothing of it may still run."""
    pids: list[int] = []
    with deployed_stack(tmp_path_factory) as config:
        pids = [s.pid for s in stack_mod.status(config) if s.pid]
        yield config
    assert len(pids) == 5
    for pid in pids:  # workers first, then servers: and nothing left behind
        assert stack_mod.group_members(pid) == [], f"process group {pid} still running"


def _client(config: stack_mod.StackConfig) -> Any:
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(config.prefect_api_url)


def _wait_run(config: stack_mod.StackConfig, run_id: Any) -> Any:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    with _client(config) as client:
        while time.monotonic() < deadline:
            run = client.read_flow_run(run_id)
            if run.state is not None and run.state.is_final():
                return run
            time.sleep(1)
    raise AssertionError(f"flow run {run_id} not finished after {RUN_TIMEOUT_S} s")


@pytest.fixture(scope="module")
def candidates(stack: stack_mod.StackConfig) -> list[Any]:
    """Three small digits candidates, trained by runs of train-candidate/gpu that the
    deployed train-candidates/cpu fan-out creates."""
    with _client(stack) as client:
        deployment = client.read_deployment_by_name("train-candidates/cpu")
        run = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={
                "dataset": "digits",
                "noise_multipliers": [1.0, 1.6, 3.0],
                "epochs": 3,
                "batch_size": 64,
                "learning_rate": 1.0,
                "deployment": "train-candidate/gpu",
            },
        )
    finished = _wait_run(stack, run.id)
    assert finished.state.is_completed(), finished.state.message
    client = MlflowClient(stack.mlflow_url)
    found = client.search_model_versions("tags.`dp.role` = 'candidate'")
    assert len(found) == 3 and {v.tags["dp.status"] for v in found} == {"ready"}
    with _client(stack) as prefect:
        gpu_runs = [
            r
            for r in prefect.read_flow_runs()
            if r.name.startswith("train-digits-logreg") and r.work_pool_name == "gpu"
        ]
    assert len(gpu_runs) == 3 and all(r.state.is_completed() for r in gpu_runs)
    return sorted(found, key=lambda v: float(v.tags["dp.epsilon"]))


def _policy(**fields: Any) -> Any:
    base = {"name": "int", "target_delta": DELTA, "dataset": "digits", "model": "logreg"}
    return policy_from_dict({**base, **fields})


def _emit(stack: stack_mod.StackConfig, payload: dict[str, Any], name: str = "int") -> str:
    return runtime.emit_policy_event(
        payload, f"dpmerge.policy.{name}", name, url=stack.prefect_api_url
    )


def _wait_event(stack: stack_mod.StackConfig, event_id: str, timeout_s: float = 180) -> Any:
    return runtime.wait_for_policy_run(event_id, timeout_s, url=stack.prefect_api_url)


def _merged(client: MlflowClient, candidates: list[Any]) -> str:
    return candidates[0].name.replace("-candidates", "-releases")


def _alias(client: MlflowClient, model: str, alias: str) -> str | None:
    aliases = client.get_registered_model(model).aliases
    return str(aliases[alias]) if alias in aliases else None


def _served(client: MlflowClient, model: str, alias: str) -> str | None:
    """The version ``alias`` names; ``None`` also while ``model`` is not registered yet (any
    other failure is raised)."""
    try:
        return _alias(client, model, alias)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        return None


def test_policy_event_promotes_a_carded_release_stored_in_s3(stack, candidates) -> None:
    client = MlflowClient(stack.mlflow_url)
    epsilons = [float(v.tags["dp.epsilon"]) for v in candidates]
    policy = _policy(target_epsilon=epsilons[1] * 1.05, method="rs")
    start = time.monotonic()
    event_id = _emit(stack, policy.event_payload())
    merged = _merged(client, candidates)
    version = None
    while time.monotonic() - start < 180 and version is None:
        version = _served(client, merged, "policy-int")
        time.sleep(0.2)
    seconds = time.monotonic() - start
    run = _wait_event(stack, event_id)
    assert run is not None and run.state.is_completed(), run and run.state.message
    assert version is not None, "the alias never moved"
    print(f"time to policy (emit → alias moved): {seconds:.1f} s")
    mv = client.get_model_version(merged, version)
    assert mv.tags["dp.status"] == "ready" and mv.tags["dp.policy"] == "int"
    assert mv.tags["dp.method"] == "rs" and float(mv.tags["dp.epsilon"]) <= policy.target_epsilon
    assert mv.description.startswith("# Privacy card")
    card = json.loads(Path(client.download_artifacts(mv.run_id, "privacy_card.json")).read_text())
    assert card["guarantee"]["epsilon"] == float(mv.tags["dp.epsilon"])
    assert card["target"] == {"epsilon": policy.target_epsilon, "delta": DELTA, "met": True}
    assert card["ledger"]["epsilon"] >= card["guarantee"]["epsilon"]

    s3 = boto3.client(
        "s3",
        endpoint_url=stack.s3_url,
        aws_access_key_id=stack.s3_config().access_key_id,
        aws_secret_access_key=stack.s3_config().secret_access_key,
        region_name="us-east-1",
    )
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=stack.bucket)["Contents"]]
    model_id = re.search(r"m-[0-9a-f]{32}", mv.source or "")
    assert model_id is not None, mv.source
    stored = [k for k in keys if f"/models/{model_id[0]}/artifacts/" in k]
    assert any(k.endswith("extra_files/privacy_card.json") for k in stored)
    assert any(k.endswith("extra_files/weights.safetensors") for k in stored)
    assert any(k.endswith("data/model.pt2") for k in stored)
    assert "ledger/releases.json" in keys
    # the secret draw: only in the restricted audit bucket, never on the release
    audit = s3.list_objects_v2(Bucket=stack.audit_bucket)["Contents"]
    records = [
        json.loads(s3.get_object(Bucket=stack.audit_bucket, Key=o["Key"])["Body"].read())
        for o in audit
    ]
    assert [r["release"] for r in records] == [mv.tags["dp.content_hash"]]
    assert "drawn_index" in records[0]
    public = json.dumps([mv.tags, mv.description, client.get_run(mv.run_id).data.params])
    assert "drawn_index" not in public and "drawn_candidate" not in public


def test_back_to_back_events_are_serialised_and_the_later_wins(stack, candidates) -> None:
    client = MlflowClient(stack.mlflow_url)
    epsilons = [float(v.tags["dp.epsilon"]) for v in candidates]
    first = _policy(target_epsilon=epsilons[2] * 1.5, method="lc")
    later = _policy(target_epsilon=epsilons[2] * 2.0, method="rs")  # another release
    ids = [_emit(stack, first.event_payload()), _emit(stack, later.event_payload())]
    runs = [_wait_event(stack, event_id) for event_id in ids]
    assert all(r is not None and r.state.is_completed() for r in runs)
    (a_start, a_end), (b_start, b_end) = ((r.start_time, r.end_time) for r in runs)
    assert a_end <= b_start or b_end <= a_start, "the two policy runs overlapped"
    merged = _merged(client, candidates)
    version = _alias(client, merged, "policy-int")
    assert version is not None
    tags = client.get_model_version(merged, version).tags
    assert tags["dp.method"] == "rs"  # the later policy's release


def test_bad_payload_creates_no_version_and_keeps_the_alias(stack, candidates) -> None:
    client = MlflowClient(stack.mlflow_url)
    merged = _merged(client, candidates)
    alias_before = _alias(client, merged, "policy-int")
    versions_before = len(client.search_model_versions(f"name = '{merged}'"))
    payload = _policy(target_epsilon=1.0).event_payload()
    missing = {k: v for k, v in payload.items() if k != "min_accuracy"}
    missing_id = _emit(stack, missing)
    bad_id = _emit(stack, payload | {"target_epsilon": -1.0})
    run = _wait_event(stack, bad_id)
    assert run is not None and run.state.is_failed()
    assert "target_epsilon" in (run.state.message or "")
    assert _wait_event(stack, missing_id, timeout_s=3) is None  # Prefect creates no run
    assert len(client.search_model_versions(f"name = '{merged}'")) == versions_before
    assert _alias(client, merged, "policy-int") == alias_before
