"""Each role's credentials against a running stack on PostgreSQL
(docs/stack.md#roles-and-permissions): no credentials are refused everywhere; a consumer reads
releases and nothing else; an operator reads candidates and releases and writes only policies
and quarantine records; MLflow's proxied artifact and logged-model endpoints honour the
experiments' permissions; a flow run cannot change the command a worker runs, and a changed pool
template is reported and set back."""

from __future__ import annotations

import io
import json
import os
import pwd
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import requests
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError
from factories import synthetic_candidates
from servers import Shell, environment, flow_source, one_line, workflow_prefect

import devstack
from devstack import credentials, mlflow_writes, provision
from devstack.roles import prefect_headers
from dpmerge.keys import KEY_ENV, KEY_FILE_ENV, WorkflowKey
from dpmerge.merging import merge_model_dirs
from dpmerge.publication import dataset_id
from dpmerge.registry import Registry, candidate_model_name, merged_model_name
from dpmerge.vocabulary import FindingKind, StackRole

pytestmark = pytest.mark.integration

DELTA = 1e-5
DATASET = "roles-sha256:00112233445566778899"
POLICY = {"id": "policy-roles", "target_epsilon": 50.0, "target_delta": DELTA}
QUICK_FLOW = "from prefect import flow\n\n@flow\ndef quick() -> int:\n    return 1\n"


class Registered:
    """What the workflow registered: a candidate and a release, with their ids and paths."""

    def __init__(self, stack: devstack.StackConfig, root: Path) -> None:
        registry = Registry(stack.mlflow_url)
        dirs = synthetic_candidates(root, {"cand-a": 1.0, "cand-b": 2.0}, DATASET)
        parents = [registry.register_candidate(d).version for d in dirs]
        merged = merge_model_dirs(dirs, "lc", [0.5, 0.5], root / "merged", delta=DELTA).path
        release = registry.register_merged(
            registry.prepare_merged(merged, parents=parents, policy=POLICY)
        )
        public = dataset_id(DATASET, WorkflowKey.from_env())
        self.candidates = candidate_model_name(public, "logreg")
        self.releases = merged_model_name(public, "logreg")
        self.release_version = release.version
        self.url = stack.mlflow_url
        workflow = _session(stack, StackRole.WORKFLOW)
        self.candidate = _get(
            workflow, self.url, "model-versions/get", name=self.candidates, version="1"
        )
        self.release = _get(
            workflow, self.url, "model-versions/get", name=self.releases, version=release.version
        )
        experiments = _post(workflow, self.url, "experiments/search", max_results=100).json()
        self.experiments = {e["name"]: e for e in experiments["experiments"]}


def _session(stack: devstack.StackConfig, role: StackRole | None) -> requests.Session:
    session = requests.Session()
    if role is not None:
        env = stack.client_env(role)
        session.auth = (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"])
    return session


def _get(session: requests.Session, url: str, path: str, **params: Any) -> Any:
    answer = session.get(f"{url}/api/2.0/mlflow/{path}", params=params, timeout=30)
    answer.raise_for_status()
    return answer.json()["model_version"]


def _post(session: requests.Session, url: str, path: str, **body: Any) -> requests.Response:
    return session.post(f"{url}/api/2.0/mlflow/{path}", json=body, timeout=30)


def _s3(stack: devstack.StackConfig, role: StackRole | None) -> Any:
    if role is None:
        return boto3.client(
            "s3",
            endpoint_url=stack.s3_url,
            region_name="us-east-1",
            config=Config(signature_version=UNSIGNED, retries={"max_attempts": 1}),
        )
    env = stack.client_env(role)
    return boto3.client(
        "s3",
        endpoint_url=stack.s3_url,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )


def _denied(call: Any) -> str:
    with pytest.raises(ClientError) as refused:
        call()
    return str(refused.value.response["Error"]["Code"])


@pytest.fixture(scope="module")
def registered(local_stack: devstack.StackConfig, tmp_path_factory: Any) -> Registered:
    return Registered(local_stack, tmp_path_factory.mktemp("roles"))


@pytest.fixture
def as_role(local_stack: devstack.StackConfig) -> Iterator[Any]:
    """Run a block with one role's MLflow credentials in the environment."""

    def switch(role: StackRole) -> Any:
        env = local_stack.client_env(role)
        keys = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
        return environment({k: env[k] for k in keys})

    yield switch


def _model_id(version: dict[str, Any]) -> str:
    """The logged model a version was registered from (named in its source)."""
    return next(part for part in str(version["source"]).split("/") if part.startswith("m-"))


def _artifact_paths(registered: Registered) -> dict[str, str]:
    """Proxied artifact paths of the candidate's and the release's weights."""
    paths = {}
    for role, version in (("candidate", registered.candidate), ("release", registered.release)):
        experiment = registered.experiments[f"dpmerge-{role}s"]
        assert experiment["artifact_location"] == f"mlflow-artifacts:/{experiment['experiment_id']}"
        model_id = _model_id(version)
        paths[role] = (
            f"{experiment['experiment_id']}/models/{model_id}/artifacts/extra_files/"
            "weights.safetensors"
        )
    return paths


def test_no_credentials_no_access(local_stack: devstack.StackConfig) -> None:
    anonymous = requests.Session()
    url = local_stack.mlflow_url
    assert _post(anonymous, url, "experiments/search", max_results=10).status_code == 401
    assert anonymous.get(f"{url}/api/2.0/mlflow/registered-models/search").status_code == 401
    wrong = requests.Session()
    wrong.auth = ("workflow", "not-the-password")
    assert _post(wrong, url, "experiments/search", max_results=10).status_code == 401
    api = local_stack.prefect_api_url
    assert anonymous.post(f"{api}/flow_runs/filter", json={}).status_code == 401
    assert anonymous.post(f"{api}/block_documents/filter", json={}).status_code == 401
    assert anonymous.get(f"{api}/health").json() is True  # health answers everyone
    # the UI asks for the auth string (its login page) before it calls the API
    ui = api.removesuffix("/api")
    assert anonymous.get(f"{ui}/ui-settings", timeout=30).json()["auth"] == "BASIC"
    wrong.headers["Authorization"] = "Basic d29ya2Zsb3c6bm8="  # workflow:no
    assert wrong.post(f"{api}/flow_runs/filter", json={}).status_code == 401
    s3 = _s3(local_stack, None)
    for bucket in (local_stack.bucket, local_stack.state_bucket, local_stack.audit_bucket):
        assert _denied(lambda b=bucket: s3.list_objects_v2(Bucket=b)) == "AccessDenied"
        assert _denied(lambda b=bucket: s3.put_object(Bucket=b, Key="x", Body=b"x")) == (
            "AccessDenied"
        )


def test_consumer_reads_releases_and_nothing_else(
    local_stack: devstack.StackConfig, registered: Registered, as_role: Any, tmp_path: Path
) -> None:
    import mlflow.pytorch
    import torch
    from mlflow import MlflowClient

    consumer = _session(local_stack, StackRole.CONSUMER)
    url = registered.url
    # the release: its registered model, version, run, card and model artifacts
    assert _get(consumer, url, "model-versions/get", name=registered.releases, version="1")
    run = consumer.get(
        f"{url}/api/2.0/mlflow/runs/get", params={"run_id": registered.release["run_id"]}
    )
    assert run.status_code == 200
    (tmp_path / "release").mkdir()
    with as_role(StackRole.CONSUMER):
        model = mlflow.pytorch.load_model(
            f"models:/{registered.releases}/{registered.release_version}",
            dst_path=str(tmp_path / "release"),
        )
        assert model(torch.zeros(2, 1, 4, 4)).shape == (2, 3)
        client = MlflowClient(url)
        card = client.download_artifacts(
            registered.release["run_id"], "privacy_card.md", str(tmp_path)
        )
        assert Path(card).read_text()
        visible = {e.name for e in client.search_experiments()}
        assert "dpmerge-releases" in visible and "dpmerge-candidates" not in visible
        assert not [v for v in client.search_model_versions() if v.name == registered.candidates]
    paths = _artifact_paths(registered)
    proxied = f"{url}/api/2.0/mlflow-artifacts/artifacts"
    assert consumer.get(f"{proxied}/{paths['release']}").status_code == 200
    # candidates: registered model, versions, runs, metrics, artifacts: all refused
    candidate_run = registered.candidate["run_id"]
    refused = [
        consumer.get(
            f"{url}/api/2.0/mlflow/registered-models/get", params={"name": registered.candidates}
        ),
        consumer.get(
            f"{url}/api/2.0/mlflow/model-versions/get",
            params={"name": registered.candidates, "version": "1"},
        ),
        consumer.get(
            f"{url}/api/2.0/mlflow/model-versions/get-download-uri",
            params={"name": registered.candidates, "version": "1"},
        ),
        consumer.get(f"{url}/api/2.0/mlflow/runs/get", params={"run_id": candidate_run}),
        consumer.get(
            f"{url}/api/2.0/mlflow/metrics/get-history",
            params={"run_id": candidate_run, "metric_key": "test_accuracy"},
        ),
        consumer.get(f"{url}/api/2.0/mlflow/artifacts/list", params={"run_id": candidate_run}),
        consumer.get(f"{proxied}/{paths['candidate']}"),
        consumer.get(f"{proxied}/{paths['release'].split('/')[0]}/../{paths['candidate']}"),
        consumer.get(
            f"{url}/api/2.0/mlflow-artifacts/artifacts",
            params={"path": paths["candidate"].rsplit("/", 2)[0]},
        ),
        consumer.get(f"{url}/api/2.0/mlflow/logged-models/{_model_id(registered.candidate)}"),
        consumer.get(
            f"{url}/ajax-api/2.0/mlflow/logged-models/{_model_id(registered.candidate)}"
            "/artifacts/files",
            params={"artifact_file_path": "extra_files/weights.safetensors"},
        ),
        consumer.get(
            f"{url}/model-versions/get-artifact",
            params={"name": registered.candidates, "version": "1", "path": "MLmodel"},
        ),
    ]
    assert [r.status_code for r in refused] == [403] * len(refused), [
        (r.request.url, r.status_code, r.text[:80]) for r in refused if r.status_code != 403
    ]
    candidates = [registered.experiments["dpmerge-candidates"]["experiment_id"]]
    searches = {  # a search answers, but with nothing of the candidates
        "runs": _post(consumer, url, "runs/search", experiment_ids=candidates),
        "models": consumer.post(
            f"{url}/api/2.0/mlflow/logged-models/search", json={"experiment_ids": candidates}
        ),
    }
    for key, answer in searches.items():
        assert answer.status_code in (200, 403) and not answer.json().get(key), answer.text[:200]
    # no alias, no description, no grant, no user
    name = registered.releases
    writes = [
        _post(consumer, url, "registered-models/alias", name=name, alias="mine", version="1"),
        consumer.patch(
            f"{url}/api/2.0/mlflow/model-versions/update",
            json={"name": name, "version": "1", "description": "forged card"},
        ),
        consumer.patch(
            f"{url}/api/2.0/mlflow/registered-models/update",
            json={"name": name, "description": "x"},
        ),
        _post(consumer, url, "users/create", username="mallory", password="mallory-password"),
        consumer.post(
            f"{url}/api/3.0/mlflow/users/permissions/grant",
            json={
                "username": "consumer",
                "resource_type": "registered_model",
                "resource_id": registered.candidates,
                "permission": "READ",
            },
        ),
    ]
    assert [r.status_code for r in writes] == [403] * len(writes)
    # no S3 identity at all, no Prefect
    assert not any(k.startswith("AWS_") for k in local_stack.client_env(StackRole.CONSUMER))
    assert (
        consumer.post(f"{local_stack.prefect_api_url}/flow_runs/filter", json={}).status_code == 401
    )


def test_operator_reads_candidates_and_writes_only_requests(
    local_stack: devstack.StackConfig, registered: Registered
) -> None:
    operator = _session(local_stack, StackRole.OPERATOR)
    url = registered.url
    assert _get(operator, url, "model-versions/get", name=registered.candidates, version="1")
    assert _get(operator, url, "model-versions/get", name=registered.releases, version="1")
    paths = _artifact_paths(registered)
    proxied = f"{url}/api/2.0/mlflow-artifacts/artifacts"
    assert operator.get(f"{proxied}/{paths['candidate']}").status_code == 200
    candidates = registered.experiments["dpmerge-candidates"]["experiment_id"]
    writes = [
        _post(operator, url, "runs/create", experiment_id=candidates),
        _post(
            operator,
            url,
            "model-versions/create",
            name=registered.candidates,
            source=registered.candidate["source"],
        ),
        _post(
            operator,
            url,
            "registered-models/alias",
            name=registered.releases,
            alias="op",
            version="1",
        ),
        operator.put(f"{proxied}/{paths['candidate']}", data=b"forged"),
    ]
    assert [r.status_code for r in writes] == [403] * len(writes)
    assert (
        operator.post(f"{local_stack.prefect_api_url}/block_documents/filter", json={}).status_code
        == 401
    )
    s3 = _s3(local_stack, StackRole.OPERATOR)
    state, audit, project = local_stack.state_bucket, local_stack.audit_bucket, local_stack.bucket
    workflow = _s3(local_stack, StackRole.WORKFLOW)
    workflow.put_object(Bucket=state, Key="ledger/releases.json", Body=b"{}")
    for prefix in ("inbox/policies", "inbox/quarantine"):  # requests, never state
        s3.put_object(Bucket=state, Key=f"{prefix}/op.json", Body=b"{}")
        assert s3.get_object(Bucket=state, Key=f"{prefix}/op.json")["Body"].read() == b"{}"
    assert s3.get_object(Bucket=state, Key="ledger/releases.json")["Body"].read() == b"{}"
    listed = {o["Key"] for o in s3.list_objects_v2(Bucket=state)["Contents"]}
    assert {"ledger/releases.json", "inbox/policies/op.json", "inbox/quarantine/op.json"} <= listed
    canonical = ("policies/eu/00000001.json", "quarantine/m/00000001.json", "requests/x.json")
    for key in (
        *canonical,
        "ledger/releases.json",
        "serving/policy-eu.json",
        "releases/r.json",
        "leases/x",
    ):
        assert _denied(lambda k=key: s3.put_object(Bucket=state, Key=k, Body=b"x")) == (
            "AccessDenied"
        )
    assert _denied(lambda: s3.delete_object(Bucket=state, Key="ledger/releases.json"))
    assert _denied(lambda: s3.list_objects_v2(Bucket=audit)) == "AccessDenied"
    assert _denied(lambda: s3.get_object(Bucket=audit, Key="releases/x.json")) == "AccessDenied"
    assert _denied(lambda: s3.list_objects_v2(Bucket=project)) == "AccessDenied"
    assert _denied(
        lambda: s3.put_bucket_versioning(
            Bucket=state, VersioningConfiguration={"Status": "Suspended"}
        )
    )


def test_mlflow_writes_are_an_allow_list(
    local_stack: devstack.StackConfig, registered: Registered
) -> None:
    """MLflow lets any signed-in user create an experiment or a registered model (and manage
    it), its UI's demo generator included (row L of the attack run); the stack's hook refuses
    every request but a read that is not on the role's allow-list, so a consumer or an operator
    can neither take a name the workflow needs nor create anything. The workflow still creates,
    and reads and searches are untouched."""
    url = registered.url
    squatted = merged_model_name("cnn-squat", "cnn")
    attempts = (
        ("POST", "/ajax-api/3.0/mlflow/demo/generate", {}),
        ("POST", "/api/2.0/mlflow/experiments/create", {"name": "dpmerge-studies-squat"}),
        ("POST", "/api/2.0/mlflow/registered-models/create", {"name": squatted}),
        ("POST", "/ajax-api/2.0/mlflow/registered-models/create", {"name": squatted}),
        ("POST", "/api/3.0/mlflow/gateway/model-definitions/create", {"name": "squat"}),
        ("POST", "/api/2.0/mlflow/webhooks", {"name": "squat", "url": "http://127.0.0.1:9"}),
        ("POST", "/api/2.0/mlflow/traces", {}),
        ("POST", "/api/3.0/mlflow/datasets/create", {"name": "squat"}),
        ("POST", "/api/3.0/mlflow/scorers/register", {"name": "squat"}),
        ("POST", "/api/2.0/mlflow/logged-models", {"experiment_id": "0"}),
        ("POST", "/v1/traces", {}),
    )
    for role in (StackRole.CONSUMER, StackRole.OPERATOR):
        session = _session(local_stack, role)
        answers = [session.request(m, f"{url}{path}", json=body) for m, path, body in attempts]
        expected = [(403, mlflow_writes.refusal(role.value, m, p)) for m, p, _ in attempts]
        assert [(r.status_code, r.text) for r in answers] == expected
        found = _post(session, url, "experiments/search", max_results=100)
        assert found.status_code == 200  # a POST that reads is still answered
    workflow = _session(local_stack, StackRole.WORKFLOW)
    found = workflow.get(
        f"{url}/api/2.0/mlflow/registered-models/search",
        params={"filter": f"name = '{squatted}'"},
        timeout=30,
    )
    assert found.status_code == 200 and not found.json().get("registered_models"), found.text
    admin = requests.Session()  # sees every experiment, whoever created it
    admin.auth = (credentials.MLFLOW_ADMIN, credentials.require(local_stack.state_dir).mlflow_admin)
    everything = _post(admin, url, "experiments/search", max_results=1000).json()["experiments"]
    names = {e["name"] for e in everything}
    assert not {"MLflow Demo", "dpmerge-studies-squat"} & names, names
    created = _post(workflow, url, "experiments/create", name="dpmerge-roles-created")
    assert created.status_code == 200, created.text[:200]
    demo = workflow.post(f"{url}/ajax-api/3.0/mlflow/demo/generate", json={}, timeout=30)
    assert demo.status_code == 403  # not on the workflow's list either


def test_a_consumer_gets_no_local_stand_in_for_the_stacks_state(
    local_stack: devstack.StackConfig, registered: Registered, tmp_path: Path
) -> None:
    """A consumer's shell (no S3 settings) in a checkout whose stack is recorded: a command
    that needs the release-state store is refused in one line (exit 2) instead of reading and
    writing a local ``.dpmerge/state`` or making a local key; ``registry ls`` still lists."""
    shell = Shell.of(local_stack, StackRole.CONSUMER, tmp_path)
    shell = Shell(
        shell.role, {**shell.env, "DPMERGE_STACK_DIR": str(local_stack.state_dir)}, tmp_path
    )
    home = Path(shell.env["DPMERGE_HOME"])
    for argv in (
        ("registry", "quarantine", registered.releases, str(registered.release_version)),
        ("registry", "verify"),
        ("policy", "ls"),
    ):
        done = shell.dpmerge(*argv, timeout=300)
        assert done.returncode == 2, (argv, done.stdout[-500:], done.stderr[-1500:])
        assert "no access to the stack's release-state store" in one_line(done), argv
    listed = shell.dpmerge("registry", "ls", timeout=300)
    assert listed.returncode == 0 and registered.releases in listed.stdout, listed.stderr[-1500:]
    assert not (home / "state").exists() and not (home / "secret.key").exists()


def test_workflow_holds_state_audit_and_the_ledger_but_not_the_artifact_store(
    local_stack: devstack.StackConfig, registered: Registered
) -> None:
    key_file = str(credentials.workflow_key_file(local_stack.state_dir))
    assert local_stack.client_env()[KEY_FILE_ENV] == key_file
    with environment({KEY_ENV: "", KEY_FILE_ENV: key_file}):  # as the workers find the key
        key = WorkflowKey.from_env()
    assert key.source == key_file
    assert key.material.hex() == credentials.workflow_key(local_stack.state_dir)
    s3 = _s3(local_stack, StackRole.WORKFLOW)
    for bucket in (local_stack.state_bucket, local_stack.audit_bucket):
        s3.upload_fileobj(io.BytesIO(b"{}"), bucket, "probe/workflow.json")
        assert "probe/workflow.json" in {
            o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]
        }
        s3.delete_object(Bucket=bucket, Key="probe/workflow.json")
    project = local_stack.bucket
    paths = _artifact_paths(registered)
    key = f"mlartifacts/{paths['candidate']}"
    assert _denied(lambda: s3.get_object(Bucket=project, Key=key)) == "AccessDenied"
    assert _denied(lambda: s3.put_object(Bucket=project, Key=key, Body=b"x")) == "AccessDenied"
    assert _denied(lambda: s3.list_objects_v2(Bucket=project)) == "AccessDenied"
    admin = boto3.client(
        "s3",
        endpoint_url=local_stack.s3_url,
        aws_access_key_id=local_stack.s3_config().access_key_id,
        aws_secret_access_key=local_stack.s3_config().secret_access_key,
        region_name="us-east-1",
    )
    assert admin.head_object(Bucket=project, Key=key)["ContentLength"] > 0  # it is there


def test_a_flow_run_cannot_change_the_workers_command(local_stack: devstack.StackConfig) -> None:
    """Job variables a flow run brings are refused where Prefect validates them (a run of a
    deployment: 422, the pool's schema admits none) and ignored where it does not (a run
    created through ``POST /flow_runs/`` keeps them, but the template has no placeholder)."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    directory = flow_source("quick.py", QUICK_FLOW)
    directory.chmod(0o777)  # the worker user could write the marker here, had it run the command
    marker = directory / "marker"
    attempts = ({"command": f"touch {marker}"}, {"env": {"X": "1"}}, {"working_dir": "/"})
    with workflow_prefect(local_stack), get_client(sync_client=True) as api:
        source = flow.from_source(source=str(directory), entrypoint="quick.py:quick")
        deployment_id = source.deploy(name="quick", work_pool_name="gpu", print_next_steps=False)
        for variables in attempts:
            with pytest.raises(PrefectHTTPStatusError) as refused:
                api.create_flow_run_from_deployment(deployment_id, job_variables=variables)
            assert refused.value.response.status_code == 422
            name = next(iter(variables))
            assert f"Additional properties are not allowed ('{name}' was unexpected)" in (
                refused.value.response.text
            )
        deployment = api.read_deployment(deployment_id)
        pool = api.read_work_pool("gpu")
    headers = prefect_headers(credentials.require(local_stack.state_dir))
    created = requests.post(
        f"{local_stack.prefect_api_url}/flow_runs/",
        json={
            "flow_id": str(deployment.flow_id),
            "deployment_id": str(deployment_id),
            "work_pool_name": "gpu",
            "job_variables": attempts[0],
            "state": {"type": "SCHEDULED"},
        },
        headers=headers,
        timeout=30,
    )
    assert created.status_code == 201 and created.json()["job_variables"] == attempts[0]
    run_url = f"{local_stack.prefect_api_url}/flow_runs/{created.json()['id']}"
    deadline = time.monotonic() + 180
    while (state := requests.get(run_url, headers=headers, timeout=30).json()["state"])[
        "type"
    ] not in ("COMPLETED", "FAILED", "CRASHED"):
        assert time.monotonic() < deadline, state
        time.sleep(1)
    assert state["type"] == "COMPLETED"  # the pool's own command ran the flow
    assert not marker.exists()
    assert pool.base_job_template["variables"]["properties"] == {}
    assert pool.base_job_template["job_configuration"]["command"].endswith("-m prefect.engine")


def _tamper_with_pool(stack: devstack.StackConfig, command: str) -> str:
    """Row B of issue 28: with the workflow's Prefect credential, give the ``cpu`` pool a base
    job template that runs ``command``; the command the pool then has."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate

    template = provision.locked_template("cpu")
    template["job_configuration"]["command"] = command
    with workflow_prefect(stack), get_client(sync_client=True) as api:
        api.update_work_pool("cpu", WorkPoolUpdate(base_job_template=template))
        return str(api.read_work_pool("cpu").base_job_template["job_configuration"]["command"])


def _cpu_template(stack: devstack.StackConfig) -> dict[str, Any]:
    from prefect.client.orchestration import get_client

    with workflow_prefect(stack), get_client(sync_client=True) as api:
        return api.read_work_pool("cpu").base_job_template


def test_a_changed_pool_template_is_reported_unhealthy_and_set_back(
    local_stack: devstack.StackConfig, tmp_path: Path, capsys: Any
) -> None:
    """``stack status`` reports the worker of a pool whose template was changed unhealthy, in
    one line naming the command, and sets the template back; ``verify-state``'s check finds and
    sets back the same change."""
    from flows.cli import main
    from flows.verify import pool_findings

    command = f"touch {tmp_path / 'marker'}"
    assert _tamper_with_pool(local_stack, command) == command
    capsys.readouterr()
    assert main(["stack", "status", "--state-dir", str(local_stack.state_dir)]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if "work pool cpu" in line]
    assert lines == [
        "  worker-cpu: unhealthy: pool_template_drift: work pool cpu: its base job template is "
        f"not the provisioned one (command {command!r}, provisioned 'python -m flows.warm') — "
        "repaired: template set back"
    ]
    assert _cpu_template(local_stack) == provision.locked_template("cpu")
    worker = next(s for s in devstack.status(local_stack) if s.name == "worker-cpu")
    assert worker.reason is None

    assert _tamper_with_pool(local_stack, command) == command
    with workflow_prefect(local_stack):
        found = pool_findings(repair=True)
        assert [(f.kind, f.subject, f.repaired) for f in found] == [
            (FindingKind.POOL_TEMPLATE_DRIFT, "work pool cpu", "template set back")
        ]
        assert pool_findings(repair=False) == []
    assert _cpu_template(local_stack) == provision.locked_template("cpu")


def test_the_key_is_in_no_prefect_secret_block(local_stack: devstack.StackConfig) -> None:
    """The Prefect credential reads no key: ``up`` saves none, and deletes the Secret block an
    earlier version saved it in."""
    from prefect.blocks.system import Secret

    with workflow_prefect(local_stack):
        with pytest.raises(ValueError):
            Secret.load(provision.OLD_SECRET_BLOCK)
        Secret(value="33" * 32).save(provision.OLD_SECRET_BLOCK)  # as an earlier version did
    provision.remove_secret_block(local_stack, credentials.require(local_stack.state_dir))
    with workflow_prefect(local_stack), pytest.raises(ValueError):
        Secret.load(provision.OLD_SECRET_BLOCK)
    provision.remove_secret_block(local_stack, credentials.require(local_stack.state_dir))


WHOAMI_FLOW = """
import json, os
from pathlib import Path
from prefect import flow

@flow
def whoami(report: str, admin: str) -> None:
    try:
        Path(admin).read_text()
        admin_read = "read"
    except PermissionError:
        admin_read = "PermissionError"
    key = Path(os.environ["DPMERGE_SECRET_KEY_FILE"]).read_text().strip()
    Path(report).write_text(json.dumps({"uid": os.getuid(), "admin": admin_read, "key": key}))
"""


def _wait_for(path: Path, timeout_s: float = 180.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.is_file() or not path.read_text():
        assert time.monotonic() < deadline, f"nothing wrote {path}"
        time.sleep(1)
    return path.read_text()


def test_flow_runs_and_a_changed_template_run_as_the_worker_user(
    local_stack: devstack.StackConfig,
) -> None:
    """Issue 28 row B: a flow run is not root, cannot read the stack's credentials and reads
    the workflow key; a command a changed base job template runs is the worker user's too
    (docs/stack.md#worker-user)."""
    from prefect import flow
    from prefect.deployments import run_deployment

    if os.geteuid() != 0:
        pytest.skip("the worker user needs `up` as root (docs/stack.md#worker-user)")
    worker_uid = pwd.getpwnam(local_stack.worker_user).pw_uid
    reports = flow_source("whoami.py", WHOAMI_FLOW)
    reports.chmod(0o777)  # the flow run writes its answers here
    admin = credentials.secrets_dir(local_stack.state_dir) / credentials.CREDENTIALS_FILE
    with workflow_prefect(local_stack):
        source = flow.from_source(source=str(reports), entrypoint="whoami.py:whoami")
        source.deploy(name="whoami", work_pool_name="cpu", print_next_steps=False)
        parameters = {"report": str(reports / "run.json"), "admin": str(admin)}
        run_deployment("whoami/whoami", parameters=parameters, timeout=0)
    seen = json.loads(_wait_for(reports / "run.json"))
    assert seen == {
        "uid": worker_uid,
        "admin": "PermissionError",
        "key": credentials.workflow_key(local_stack.state_dir),
    }
    assert worker_uid != 0

    marker = reports / "tampered"
    write_uid = f"import os; open({str(marker)!r}, 'w').write(str(os.getuid()))"
    _tamper_with_pool(local_stack, shlex.join(["python", "-c", write_uid]))
    try:
        with workflow_prefect(local_stack):
            run_deployment("whoami/whoami", parameters=parameters, timeout=0)
        assert _wait_for(marker) == str(worker_uid)
    finally:
        devstack.status(local_stack)  # sets the template back
    assert _cpu_template(local_stack) == provision.locked_template("cpu")
