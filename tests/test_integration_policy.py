"""The workflow on the real local stack (S3, MLflow on S3, Prefect server, cpu/gpu
workers polling every second): deploy deployments/prefect.yaml, train candidates through the
``gpu`` pool, then drive ``merge-on-policy`` with ``dpmerge.policy.updated`` events: every event
becomes a run (applied or rejected), one policy at a time, policies side by side, the same
outcomes and exit codes as in-process."""

from __future__ import annotations

import json
import os
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
from servers import workflow_prefect

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
    assert len(pids) == 6  # S3, PostgreSQL, MLflow, Prefect, two workers
    for pid in pids:  # workers first, then servers: and nothing left behind
        assert stack_mod.group_members(pid) == [], f"process group {pid} still running"


def _client(config: stack_mod.StackConfig) -> Any:
    from prefect.client.orchestration import SyncPrefectClient

    auth = config.client_env()["PREFECT_API_AUTH_STRING"]
    return SyncPrefectClient(config.prefect_api_url, auth_string=auth)


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
    """Three small digits candidates, trained by runs of train-candidate-gpu that the deployed
    train-candidates fan-out creates."""
    with _client(stack) as client:
        deployment = client.read_deployment_by_name("train-candidates/train-candidates")
        run = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={
                "dataset": "digits",
                "noise_multipliers": [1.0, 1.6, 3.0],
                "epochs": 3,
                "batch_size": 64,
                "learning_rate": 1.0,
                "deployment": "train-candidate/train-candidate-gpu",
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
    with workflow_prefect(stack):  # the events client reads the auth string from settings
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
    """The version ``alias`` names; ``None`` also while ``model`` is not registered yet (MLflow's
    auth app answers PERMISSION_DENIED for a model nobody granted yet; any other failure is
    raised)."""
    try:
        return _alias(client, model, alias)
    except MlflowException as error:
        if error.error_code not in ("RESOURCE_DOES_NOT_EXIST", "PERMISSION_DENIED"):
            raise
        return None


def _completed(run: Any) -> bool:
    return run.id is not None and run.state == "Completed"


def test_deployments_and_automation_are_named_for_what_they_run(stack, candidates) -> None:
    with _client(stack) as client:
        names = {f"{client.read_flow(d.flow_id).name}/{d.name}" for d in client.read_deployments()}
        automations = {a.name: a.description for a in client.read_automations()}
    assert names == {
        "merge-on-policy/merge-on-policy",
        "train-candidates/train-candidates",
        "train-candidate/train-candidate-gpu",
        "pareto-report/pareto-report-nightly",
    }
    assert "apply a policy when dpmerge.policy.updated is emitted" in automations


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
    assert _completed(run), run
    assert run.outcome["status"] == "promoted" and run.outcome["version"] == version
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
    # the run started from the warm flow-run process (flows/warm.py), not a fresh interpreter
    assert list((Path(os.environ["DPMERGE_HOME"]) / "run").glob("engine-*.sock"))


def _work_span(stack: stack_mod.StackConfig, run_id: Any) -> tuple[Any, Any] | None:
    """First task start and last task end of a run: its work under the policy's lock."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with _client(stack) as client:
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
        )
    times = [(t.start_time, t.end_time) for t in tasks if t.start_time and t.end_time]
    return (min(a for a, _ in times), max(b for _, b in times)) if times else None


def test_one_policy_at_a_time_the_later_event_wins(stack, candidates) -> None:
    client = MlflowClient(stack.mlflow_url)
    epsilons = [float(v.tags["dp.epsilon"]) for v in candidates]
    first = _policy(target_epsilon=epsilons[2] * 1.5, method="lc")
    later = _policy(target_epsilon=epsilons[2] * 2.0, method="rs")  # another release
    ids = [_emit(stack, first.event_payload()), _emit(stack, later.event_payload())]
    runs = [_wait_event(stack, event_id) for event_id in ids]
    assert runs[1].state == "Completed" and runs[0].state in ("Completed", "Superseded")
    spans = [_work_span(stack, r.id) for r in runs]
    if all(spans):  # both did work: never at the same time
        (a0, a1), (b0, b1) = spans
        assert a1 <= b0 or b1 <= a0, "two runs of one policy overlapped"
    merged = _merged(client, candidates)
    version = _alias(client, merged, "policy-int")
    tags = client.get_model_version(merged, version).tags
    assert tags["dp.method"] == "rs"  # the later policy's release


def test_different_policies_run_side_by_side(stack, candidates) -> None:
    """The lock is per policy: while policy side-a's lock is held (here, by the test), an event
    for side-b is applied and one for side-a waits; released, side-a's run completes."""
    from flows.policy_runs import policy_lock
    from prefect.settings import PREFECT_API_URL, temporary_settings

    epsilons = [float(v.tags["dp.epsilon"]) for v in candidates]
    side_a, side_b = (
        _policy(name=name, target_epsilon=epsilons[2] * factor, method="lc")
        for name, factor in (("side-a", 1.7), ("side-b", 1.9))
    )
    # this process's Prefect settings may predate the stack (another module's test server)
    with temporary_settings({PREFECT_API_URL: stack.prefect_api_url}), policy_lock("side-a"):
        id_a = _emit(stack, side_a.event_payload(), "side-a")
        id_b = _emit(stack, side_b.event_payload(), "side-b")
        assert _wait_event(stack, id_b).state == "Completed"
        waiting = _wait_event(stack, id_a, timeout_s=3)
        assert waiting.state not in ("Completed", "Superseded"), waiting
    assert _wait_event(stack, id_a).state == "Completed"


MALFORMED = {
    "missing target": lambda p: {k: v for k, v in p.items() if k != "target_epsilon"},
    "string for a number": lambda p: p | {"target_epsilon": "2.0"},
    "boolean for a number": lambda p: p | {"min_accuracy": True},
    "null for a number": lambda p: p | {"target_delta": None},
    "extra field": lambda p: p | {"gpu": "yes"},
    "negative target": lambda p: p | {"target_epsilon": -1.0},
    "typo'd dataset": lambda p: p | {"dataset": "digitz"},
}


def test_every_malformed_event_is_a_rejected_run(stack, candidates) -> None:
    """The red team's silently dropped events: each now ends as a visible ``Rejected`` run
    with one line naming the field, and nothing changes."""
    client = MlflowClient(stack.mlflow_url)
    merged = _merged(client, candidates)
    alias_before = _alias(client, merged, "policy-int")
    versions_before = len(client.search_model_versions(f"name = '{merged}'"))
    payload = _policy(target_epsilon=1.0).event_payload()
    ids = {case: _emit(stack, change(payload)) for case, change in MALFORMED.items()}
    runs = {case: _wait_event(stack, event_id) for case, event_id in ids.items()}
    rejected = [case for case, run in runs.items() if run.state == "Rejected"]
    assert sorted(rejected) == sorted(MALFORMED), {c: (r.state, r.message) for c, r in runs.items()}
    for run in runs.values():
        assert run.outcome["status"] == "rejected" and "\n" not in run.message
    assert "target_epsilon" in runs["missing target"].message
    assert "unknown field 'gpu'" in runs["extra field"].message
    assert "field 'dataset'" in runs["typo'd dataset"].message
    assert len(client.search_model_versions(f"name = '{merged}'")) == versions_before
    assert _alias(client, merged, "policy-int") == alias_before


def test_outcome_exit_codes_are_the_embedded_ones(stack, candidates, capsys) -> None:
    """``dpmerge policy set --wait`` on the stack exits as in-process (tests/test_flows.py):
    3 infeasible, 4 not promoted; one line each, no traceback."""
    from flows.cli import main

    epsilons = [float(v.tags["dp.epsilon"]) for v in candidates]
    base = ["policy", "set", "--name", "codes", "--delta", "1e-5", "--dataset", "digits"]
    infeasible = [*base, "--target-epsilon", f"{epsilons[0] / 2:.4f}", "--wait", "180"]
    assert main(infeasible) == 3
    out, err = capsys.readouterr()
    assert out.startswith("policy codes: infeasible — ") and "Traceback" not in out + err
    strict = [*base, "--target-epsilon", f"{epsilons[2] * 1.3:.4f}", "--min-accuracy", "0.999"]
    assert main([*strict, "--wait", "180"]) == 4
    assert capsys.readouterr().out.startswith("policy codes: not promoted — ")
    typo = [*base[:-1], "digitz", "--target-epsilon", "2"]  # --dataset digitz, given once
    assert main(typo) == 2  # before any event
