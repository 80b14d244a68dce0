"""The product on the real local stack, as its three roles meet it (docs/stack.md,
docs/serving.md): deployments/prefect.yaml applied, digits candidates trained by the workflow's
``train-candidates`` deployment, then

* an **operator** — a shell holding only ``dpmerge stack env --role operator`` — stores policy
  versions with ``dpmerge policy set --wait``; the stack's dispatcher turns each into a
  ``merge-on-policy`` run on the ``cpu`` worker; exit codes are the embedded ones;
* a **consumer** — only ``--role consumer`` — verifies the served release (``dpmerge verify``),
  loads it and serves it with ``mlflow models serve``; its predictions are the card's accuracy;
* an **attacker** holding the stack's S3 admin keys and the workflow's MLflow login but not the
  workflow key forges a candidate's record and swaps served weights: both are refused.

Last, MLflow hung and then killed: runs end ``Failed`` within a bounded time (the stack is torn
down afterwards, and no process of it may survive)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
import requests
import torch
from botocore.exceptions import ClientError
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from servers import (
    BIN,
    RUN_TIMEOUT_S,
    PolicyStack,
    Shell,
    one_line,
    policy_stack,
    prefect_client,
    wait_run,
)

import devstack
from devstack import credentials
from devstack.credentials import MLFLOW_ADMIN
from devstack.processes import descendants
from devstack.supervisor import Supervisor
from devstack.worker_user import supervised_user, worker_dir
from dpmerge import policy_merge as pm
from dpmerge.data import load_dataset
from dpmerge.policies import Policy, policy_from_dict
from dpmerge.policy_merge import Workspace
from dpmerge.policy_merge.draws import ACCURACY_SUFFIX
from dpmerge.registry import candidate_content_hash
from dpmerge.state import inbox
from dpmerge.state import policies as stored_policies
from dpmerge.state.policies import PolicyVersion
from dpmerge.state.store import stamp
from dpmerge.vocabulary import StackRole
from flows.commands.policy import wait_for_outcome

pytestmark = pytest.mark.integration

DELTA = 1e-5
BASE = ("--delta", "1e-5", "--dataset", "digits", "--model", "logreg")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PolicyStack]:
    with policy_stack(tmp_path_factory) as deployed:
        yield deployed


@pytest.fixture(scope="module")
def operator(stack: PolicyStack, tmp_path_factory: pytest.TempPathFactory) -> Shell:
    return stack.shell(StackRole.OPERATOR, tmp_path_factory.mktemp("operator"))


@pytest.fixture(scope="module")
def consumer(stack: PolicyStack, tmp_path_factory: pytest.TempPathFactory) -> Shell:
    return stack.shell(StackRole.CONSUMER, tmp_path_factory.mktemp("consumer"))


def _set(operator: Shell, name: str, *fields: str) -> tuple[int, dict[str, Any]]:
    """``dpmerge policy set`` as the operator, waiting for the run's outcome (JSON)."""
    done = operator.dpmerge(
        "policy", "set", "--name", name, *BASE, *fields, "--wait", str(RUN_TIMEOUT_S), "--json",
        timeout=RUN_TIMEOUT_S + 120,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stdout.strip(), done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


def _mlflow(stack: PolicyStack) -> MlflowClient:
    """The workflow's MLflow client (this process holds the workflow's environment)."""
    return MlflowClient(stack.config.mlflow_url)


def _aliases(stack: PolicyStack) -> dict[str, str]:
    model = _mlflow(stack).get_registered_model(stack.releases_model)
    return {k: str(v) for k, v in model.aliases.items()}


def _s3(stack: PolicyStack, role: StackRole | None = None) -> Any:
    """An S3 client with the stack's own identity (an attacker holding the artifact store's
    keys), or with ``role``'s own key (``dpmerge stack env --role``)."""
    config = stack.config.s3_config()
    key_id, secret = config.access_key_id, config.secret_access_key
    if role is not None:
        env = stack.config.client_env(role)
        key_id, secret = env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    return boto3.client(
        "s3",
        endpoint_url=stack.config.s3_url,
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
        region_name=config.region,
    )


def _artifact_keys(stack: PolicyStack, model: str, version: str) -> dict[str, str]:
    """File name -> S3 key of a model version's ``extra_files`` (its weights, record, card)."""
    source = _mlflow(stack).get_model_version(model, version).source
    model_id = source.split("/models/")[1].split("/")[0]
    listed = _s3(stack).list_objects_v2(Bucket=stack.config.bucket, Prefix="mlartifacts/")
    return {
        o["Key"].rsplit("/", 1)[1]: o["Key"]
        for o in listed["Contents"]
        if f"/models/{model_id}/artifacts/extra_files/" in o["Key"]
    }


def _estimate_tolerance(stack: PolicyStack, version: str) -> float:
    """How far a release's exact test accuracy may fall from its card's DP estimate: one test
    row, plus the Laplace noise (scale 1/(n·ε)) that the estimate exceeds with probability 1e-9."""
    n = len(load_dataset("digits").test)
    epsilon = _card(stack, version)["rows"]["test"]["epsilon"]
    return 1 / n + math.log(1e9) / (n * epsilon)


def _card(stack: PolicyStack, version: str, releases: str | None = None) -> dict[str, Any]:
    """The public privacy card a release (of ``releases``, default the digits releases) carries
    in the artifact store."""
    key = _artifact_keys(stack, releases or stack.releases_model, version)["privacy_card.json"]
    body = _s3(stack).get_object(Bucket=stack.config.bucket, Key=key)["Body"].read()
    return dict(json.loads(body))


def test_deployments_are_named_for_what_they_run_and_only_the_dispatcher_starts_merges(
    stack: PolicyStack,
) -> None:
    with prefect_client(stack.config) as client:
        names = {f"{client.read_flow(d.flow_id).name}/{d.name}" for d in client.read_deployments()}
        automations = client.read_automations()
    assert names == {
        "merge-on-policy/merge-on-policy",
        "verify-state/verify-state",
        "train-candidates/train-candidates",
        "train-candidate/train-candidate-gpu",
        "pareto-report/pareto-report-nightly",
    }
    assert automations == []  # no event triggers a merge: stored versions do, via the dispatcher
    assert len(stack.candidates) == 3 and stack.epsilons == sorted(stack.epsilons)


def test_an_operator_sets_a_policy_and_the_release_is_served_counted_and_public(
    stack: PolicyStack, operator: Shell
) -> None:
    """``policy set --wait`` from the operator's shell: stored, dispatched, merged on the
    ``cpu`` worker, counted and served; MLflow holds the public card only; the RS draw is in the
    audit bucket alone."""
    target = stack.epsilons[1] * 1.05
    started = time.monotonic()
    code, outcome = _set(operator, "int", "--target-epsilon", f"{target:.6f}", "--method", "rs")
    print(f"\noperator policy set → promoted: {time.monotonic() - started:.1f} s")
    assert code == 0 and outcome["status"] == "promoted", outcome
    assert outcome["policy_version"] == 1 and outcome["epsilon"] <= target
    version = outcome["version"]
    assert _aliases(stack)["policy-int"] == version
    mv = _mlflow(stack).get_model_version(stack.releases_model, version)
    assert float(mv.tags["dp.epsilon"]) == outcome["epsilon"] and mv.tags["dp.method"] == "rs"
    assert mv.description.startswith("# Privacy card")
    files = _artifact_keys(stack, stack.releases_model, version)
    assert {"weights.safetensors", "privacy_card.json"} <= set(files)
    card = _card(stack, version)
    assert card["guarantee"]["epsilon"] == outcome["epsilon"]
    assert card["accuracy"]["test_accuracy"] == pytest.approx(outcome["test_accuracy"])
    public = json.dumps([mv.tags, mv.description, card])
    for candidate in stack.candidates:  # nothing computed from the candidates is published
        assert candidate.name not in public and candidate.run_id not in public
    assert "drawn_index" not in public, "the RS draw is published"
    internal = {"dp.weights", "dp.parents", "dp.parent_model", "dp.candidates"} & set(mv.tags)
    assert not internal, f"internal facts as tags: {internal}"
    audit = _s3(stack).list_objects_v2(Bucket=stack.config.audit_bucket)["Contents"]
    draw, estimate = sorted((o["Key"] for o in audit), key=len)  # the RS draw, the DP estimate's
    assert estimate == draw.removesuffix(".json") + ACCURACY_SUFFIX + ".json", audit
    shown = operator.dpmerge("policy", "show", "int", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["version"] == 1


def test_the_same_policy_again_is_unchanged_and_bad_input_changes_nothing(
    stack: PolicyStack, operator: Shell
) -> None:
    aliases = _aliases(stack)
    target = stack.epsilons[1] * 1.05
    again = operator.dpmerge("policy", "set", "--name", "int", "--target-epsilon", f"{target:.6f}")
    assert again.returncode == 0 and "no change" in again.stdout, again.stdout + again.stderr
    for bad in (("--target-epsilon", "true"), ("--dataset", "digitz"), ("--min-accuracy", "1.5")):
        done = operator.dpmerge("policy", "set", "--name", "int", *bad)
        line = one_line(done)  # names the option or the policy field
        assert done.returncode == 2 and bad[0].strip("-").replace("-", "_") in line.replace(
            "-", "_"
        ), line
    history = operator.dpmerge("policy", "history", "int", "--json")
    assert history.returncode == 0 and len(json.loads(history.stdout)["history"]) == 1
    assert _aliases(stack) == aliases


def _verified(consumer: Shell) -> dict[str, Any]:
    """``dpmerge verify @policy-int`` in the consumer's shell (public key only), as the
    ``dpmerge`` script runs it; the check loads no torch (it reads files, never a module:
    1.6 s to start instead of 3.2)."""
    answer = consumer.python(
        "import contextlib, io, json, sys\n"
        "import flows.cli\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    code = flows.cli.main(['verify', '@policy-int', '--json'])\n"
        "print(json.dumps({'code': code, 'out': out.getvalue(), 'torch': 'torch' in sys.modules}))"
    )
    assert (answer["code"], answer["torch"]) == (0, False), answer
    return dict(json.loads(answer["out"]))


def _served_accuracy(stack: PolicyStack, consumer: Shell) -> float:
    """Test-split accuracy of what ``mlflow models serve`` answers for
    ``models:/<releases>@policy-int``, started in the consumer's shell and queried over HTTP
    with the digits test images (docs/serving.md)."""
    test = load_dataset("digits").test
    rows = test.features.numpy()  # (n, 1, 8, 8) float32: pixels / 16 (docs/serving.md)
    server, url = _serve(consumer, f"models:/{stack.releases_model}@policy-int")
    try:
        answer = requests.post(f"{url}/invocations", json={"inputs": rows.tolist()}, timeout=120)
        assert answer.ok, answer.text[:2000]
        predicted = np.asarray(answer.json()["predictions"]).argmax(axis=1)
    finally:
        _stop(server)
    return float((predicted == test.labels.numpy()).mean())


def test_a_consumer_verifies_and_serves_the_release_and_reaches_nothing_else(
    stack: PolicyStack, consumer: Shell
) -> None:
    """With only the consumer's credentials: ``dpmerge verify @policy-int`` passes, the
    candidates and the alias are out of reach, and the model served by ``mlflow models serve``
    predicts the test split at exactly the accuracy its card states."""
    document = _verified(consumer)
    version = document["version"]
    assert version == _aliases(stack)["policy-int"]
    mv = _mlflow(stack).get_model_version(stack.releases_model, version)
    assert document["epsilon"] == float(mv.tags["dp.epsilon"])
    reach = consumer.python(
        "import json, mlflow\n"
        "from mlflow.exceptions import MlflowException\n"
        "client = mlflow.MlflowClient()\n"
        "try:\n"
        f"    client.get_registered_model({stack.candidates_model!r}); candidates = 'read'\n"
        "except MlflowException as e:\n"
        "    candidates = e.error_code\n"
        "try:\n"
        f"    client.set_registered_model_alias({stack.releases_model!r}, 'mine', {version!r})\n"
        "    alias = 'moved'\n"
        "except MlflowException as e:\n"
        "    alias = e.error_code\n"
        "print(json.dumps({'candidates': candidates, 'alias': alias}))\n"
    )
    assert reach == {"candidates": "PERMISSION_DENIED", "alias": "PERMISSION_DENIED"}
    accuracy, stated = _served_accuracy(stack, consumer), _card(stack, version)["accuracy"]
    print(f"\nserved v{version}: test accuracy {accuracy:.4f}, card {stated['test_accuracy']:.4f}")
    assert abs(accuracy - stated["test_accuracy"]) <= _estimate_tolerance(stack, version)


def test_outcomes_exit_as_documented_and_the_newest_version_wins(
    stack: PolicyStack, operator: Shell
) -> None:
    """3 infeasible, 4 not promoted (each leaves the alias alone); then two versions of one
    policy stored back to back: the later one's release ends up served."""
    aliases = _aliases(stack)
    code, outcome = _set(operator, "codes", "--target-epsilon", f"{stack.epsilons[0] / 2:.6f}")
    assert code == 3 and outcome["status"] == "infeasible", outcome
    strict = ("--target-epsilon", f"{stack.epsilons[2] * 1.3:.6f}", "--min-accuracy", "0.999")
    code, outcome = _set(operator, "codes", *strict)
    assert code == 4 and outcome["status"] == "not_promoted", outcome
    assert _aliases(stack) == aliases
    first = operator.dpmerge(
        "policy", "set", "--name", "int", "--target-epsilon", f"{stack.epsilons[2] * 1.5:.6f}",
        "--method", "lc",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    code, outcome = _set(operator, "int", "--target-epsilon", f"{stack.epsilons[2] * 2:.6f}")
    # above every candidate LC merges them all with the same weights whatever the target: the
    # later version may find its release already served by the earlier one (unchanged)
    assert code == 0 and outcome["status"] in ("promoted", "unchanged"), outcome
    assert outcome["policy_version"] == 3
    assert outcome["method"] == "lc" and _aliases(stack)["policy-int"] == outcome["version"]
    store = Workspace.from_env().state()
    second = stored_policies.read_version(store, "int", 2)
    assert second is not None
    earlier = wait_for_outcome(store, second, RUN_TIMEOUT_S)  # its run may start last
    assert earlier is not None and earlier["status"] in ("promoted", "superseded"), earlier


def test_after_the_alias_moves_a_restarted_server_serves_the_new_release(
    stack: PolicyStack, consumer: Shell
) -> None:
    """The alias now names the later version's release: verified again and served again, the
    consumer gets that release, at its card's accuracy."""
    version = _verified(consumer)["version"]
    assert version == _aliases(stack)["policy-int"]
    assert _mlflow(stack).get_model_version(stack.releases_model, version).tags["dp.method"] == "lc"
    accuracy, stated = _served_accuracy(stack, consumer), _card(stack, version)["accuracy"]
    print(f"\nreloaded v{version}: accuracy {accuracy:.4f}, card {stated['test_accuracy']:.4f}")
    assert abs(accuracy - stated["test_accuracy"]) <= _estimate_tolerance(stack, version)


class _Planned(Exception):
    """Raised by the capturing step once the release's hash is known."""


def _future_release_hash(policy: Policy) -> str:
    """The release hash a run of ``policy`` will compute, found the way anyone who can read
    the records can (here with the library's own steps, stopped before anything is written)."""
    found: list[str] = []

    def capture(workspace: Any, request: Any, entry: Any, policy: Any) -> Any:
        found.append(request.content_hash)
        raise _Planned

    version = PolicyVersion(policy, 1, stamp(), "attacker", "test")
    steps = dataclasses.replace(pm.LIBRARY_STEPS, plan_release=capture)
    with pytest.raises(_Planned):
        pm.apply_policy(version, Workspace.from_env(), run="attacker", steps=steps)
    return found[0]


def test_a_release_planted_under_a_future_hash_is_not_reused(
    stack: PolicyStack, operator: Shell
) -> None:
    """An insider with the workflow's MLflow login but not its key registers a version under
    the hash a policy's next release will have (its files and tags copied from a served release,
    status ``ready``): the run merges and serves its own signed release instead."""
    target = (stack.epsilons[1] + stack.epsilons[2]) / 2  # a subset no earlier release used
    policy = policy_from_dict(
        {"name": "planted", "target_epsilon": target, "target_delta": DELTA,
         "dataset": "digits", "model": "logreg", "method": "lc"}
    )  # fmt: skip
    future = _future_release_hash(policy)
    client = _mlflow(stack)
    genuine = client.get_model_version(stack.releases_model, _aliases(stack)["policy-int"])
    planted = client.create_model_version(
        stack.releases_model,
        f"models:/{stack.releases_model}/{genuine.version}",  # MLflow's copy of a version
        tags={**genuine.tags, "dp.content_hash": future, "dp.status": "ready"},
        description=genuine.description,
    )
    code, outcome = _set(operator, "planted", "--target-epsilon", f"{target!r}", "--method", "lc")
    assert code == 0 and outcome["status"] == "promoted", outcome
    assert outcome["version"] != str(planted.version) and not outcome["reused"]
    served = client.get_model_version(stack.releases_model, outcome["version"])
    assert served.tags["dp.content_hash"] == future  # the same release, merged and signed anew
    assert _aliases(stack)["policy-planted"] == outcome["version"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _serve(consumer: Shell, uri: str) -> tuple[subprocess.Popen[bytes], str]:
    """``mlflow models serve`` of ``uri`` in the consumer's shell, once it answers /ping."""
    port = _free_port()
    server = subprocess.Popen(
        [str(BIN / "mlflow"), "models", "serve", "-m", uri, "--env-manager", "local",
         "--host", "127.0.0.1", "--port", str(port)],
        env=consumer.env, cwd=consumer.cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stderr.read().decode()[-3000:] if server.stderr else ""
        try:
            if requests.get(f"{url}/ping", timeout=5).ok:
                return server, url
        except requests.ConnectionError:
            pass
        time.sleep(1)
    os.killpg(server.pid, signal.SIGKILL)
    raise AssertionError("mlflow models serve did not answer within 300 s")


def _stop(server: subprocess.Popen[bytes]) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_a_forged_candidate_is_refused_until_the_operator_quarantines_it(
    stack: PolicyStack, operator: Shell, tmp_path: Path
) -> None:
    """σ × 10 written into a candidate's record in S3 and its content-hash tag rewritten to
    match, by someone holding the store's keys and the workflow's MLflow login but not its key:
    the run is refused naming the repair; nothing is served; there is no ``registry sign`` to
    launder it; the operator's quarantine lets the policy run without it."""
    forged = stack.candidates[0]
    s3, client = _s3(stack), _mlflow(stack)
    keys = _artifact_keys(stack, forged.model, forged.version)
    for file, key in keys.items():
        (tmp_path / file).write_bytes(
            s3.get_object(Bucket=stack.config.bucket, Key=key)["Body"].read()
        )
    document = json.loads((tmp_path / "record.json").read_text())
    document["record"]["noise_multiplier"] *= 10
    (tmp_path / "record.json").write_text(json.dumps(document))
    s3.put_object(
        Bucket=stack.config.bucket,
        Key=keys["record.json"],
        Body=(tmp_path / "record.json").read_bytes(),
    )
    client.set_model_version_tag(
        forged.model, forged.version, "dp.content_hash", candidate_content_hash(tmp_path)
    )
    aliases = _aliases(stack)
    code, outcome = _set(operator, "forged", "--target-epsilon", f"{stack.epsilons[2] * 1.7:.6f}")
    reasons = " ".join(outcome.get("reasons", []))
    print(f"\nforged record: exit {code}: {reasons[:200]}")
    assert code == 2 and outcome["status"] in ("refused", "rejected"), outcome
    assert "fails verification" in reasons and "registry sign" not in reasons
    assert _aliases(stack) == aliases
    no_sign = operator.dpmerge("registry", "sign", forged.model, forged.version)
    assert no_sign.returncode == 2 and "invalid choice: 'sign'" in no_sign.stderr
    quarantined = operator.dpmerge("registry", "quarantine", forged.model, forged.version)
    assert quarantined.returncode == 0, quarantined.stderr
    code, outcome = _set(operator, "forged", "--rerun")
    assert code == 0 and outcome["status"] == "promoted", outcome
    assert f"{forged.model}/{forged.version}" not in json.dumps(outcome["candidates"])


def test_swapped_served_weights_are_refused_by_the_consumer(
    stack: PolicyStack, consumer: Shell
) -> None:
    """The served release's weights replaced in S3 by a candidate's: the consumer's ``dpmerge
    verify`` (public key only) refuses it in one line, and passes again once restored."""
    # policy-int's release merged the candidate quarantined above: it is revoked (row J)
    version = _aliases(stack)["policy-forged"]
    served = _artifact_keys(stack, stack.releases_model, version)["weights.safetensors"]
    candidate = stack.candidates[1]
    other = _artifact_keys(stack, candidate.model, candidate.version)["weights.safetensors"]
    s3, bucket = _s3(stack), stack.config.bucket
    genuine = s3.get_object(Bucket=bucket, Key=served)["Body"].read()
    s3.put_object(
        Bucket=bucket, Key=served, Body=s3.get_object(Bucket=bucket, Key=other)["Body"].read()
    )
    try:
        refused = consumer.dpmerge("verify", "@policy-forged")
    finally:
        s3.put_object(Bucket=bucket, Key=served, Body=genuine)
    assert refused.returncode == 2 and "weights.safetensors" in one_line(refused)
    assert refused.stdout == ""
    assert consumer.dpmerge("verify", "@policy-forged").returncode == 0


def _admin_describe(stack: PolicyStack, model: str, version: str, description: str) -> None:
    """Set a model version's description as MLflow's admin (``devstack/credentials.py``)."""
    admin = (MLFLOW_ADMIN, credentials.require(stack.config.state_dir).mlflow_admin)
    done = requests.patch(
        f"{stack.config.mlflow_url}/api/2.0/mlflow/model-versions/update",
        json={"name": model, "version": version, "description": description},
        auth=admin,
        timeout=60,
    )
    assert done.status_code == 200, done.text


def test_the_insider_rows_replayed_with_each_roles_own_credentials(
    stack: PolicyStack, operator: Shell, consumer: Shell, tmp_path: Path
) -> None:
    """Issue 28's rows J, H, F, G, A, E, C, D, K and I on the live stack, each write made with
    the credential the row names (the workflow's MLflow login, never its key; the operator's S3
    key and shell; the consumer's shell), each answered as docs/stack.md's table says, and the
    served release verified again after each:

    * J: the release of policy ``int`` rests on the candidate quarantined above: revoked;
    * H: ``verify --download DIR`` leaves exactly the served files; a swap in S3 afterwards
      does not reach DIR;
    * F: the workflow's login may not edit the served version's description (the card); the
      MLflow admin's edit is refused by the consumer's verify;
    * G: the alias moved to another policy's signed release: refused by the serving statement
      (the workflow's, signed and expiring, names the served version);
    * A: a version on a candidate's files carrying every tag and the card of the served release,
      the served one marked failed: the rerun refuses to reuse it and keeps the served release;
    * E, C, D: the operator's write under ``quarantine/`` is denied; a malformed quarantine
      request, a request key of another shape and a 200,000-deep array in its inbox are each
      one recorded rejection naming the field, after which the policy runs as before;
    * K: ``policy set --delta 0.5`` and ``--target-epsilon 1_0`` are refused before storing;
    * I: the served weights swapped by the store's admin: the rerun is refused and revokes;
      once they are restored the next rerun serves the release again."""
    alias, releases, client = "@policy-forged", stack.releases_model, _mlflow(stack)
    served = _aliases(stack)["policy-forged"]
    assert consumer.dpmerge("verify", alias).returncode == 0

    # J: policy-int's release merged the candidate the operator quarantined above; the run
    # after the quarantine revoked it (its closing check), so consumers find nothing to verify
    assert "policy-int" not in _aliases(stack)
    assert consumer.dpmerge("verify", "@policy-int").returncode == 2

    # H
    target = tmp_path / "served"
    done = consumer.dpmerge("verify", alias, "--download", str(target))
    assert done.returncode == 0 and f"mlflow models serve -m {target} " in done.stdout, done.stderr
    served_weights = _artifact_keys(stack, releases, served)["weights.safetensors"]
    s3, bucket = _s3(stack), stack.config.bucket
    genuine = s3.get_object(Bucket=bucket, Key=served_weights)["Body"].read()
    (weights,) = list(target.rglob("weights.safetensors"))
    assert weights.read_bytes() == genuine
    other = stack.candidates[1]
    swapped = _artifact_keys(stack, other.model, other.version)["weights.safetensors"]
    candidate_weights = s3.get_object(Bucket=bucket, Key=swapped)["Body"].read()
    s3.put_object(Bucket=bucket, Key=served_weights, Body=candidate_weights)
    try:
        assert weights.read_bytes() == genuine
        assert consumer.dpmerge("verify", alias).returncode == 2
    finally:
        s3.put_object(Bucket=bucket, Key=served_weights, Body=genuine)

    # F: the workflow's login may not edit a version at all (not on its allow-list); MLflow's
    # admin may, and the consumer's verify then refuses the card it reads
    card = client.get_model_version(releases, served).description
    forged_card = re.sub(r"ε = [0-9.]+", "ε = 0.01", card, count=1)
    assert forged_card != card
    with pytest.raises(MlflowException, match="not on the MLflow allow-list of the role 'workfl"):
        client.update_model_version(releases, served, description=forged_card)
    _admin_describe(stack, releases, served, forged_card)
    try:
        refused = consumer.dpmerge("verify", alias)
        assert refused.returncode == 2 and "description" in one_line(refused)
    finally:
        _admin_describe(stack, releases, served, card)
    assert consumer.dpmerge("verify", alias).returncode == 0

    # G: the alias moved to another policy's signed release (policy int's first, RS)
    store = Workspace.from_env().state()
    first = stored_policies.outcomes(store, "int", 1)
    moved = next(str(o["version"]) for o in first if o.get("status") == "promoted")
    assert moved != served
    try:
        for _ in range(3):  # verify-state (every 5 min) may move the alias back meanwhile
            client.set_registered_model_alias(releases, "policy-forged", moved)
            refused = consumer.dpmerge("verify", alias)
            if refused.returncode != 0 or _aliases(stack)["policy-forged"] != served:
                break  # a pass while the alias still names the moved version fails below
        line = one_line(refused)
        assert refused.returncode == 2 and f"the alias serves v{moved} but the workflow's" in line
        assert f"names v{served} (policy 'forged'" in line
    finally:
        client.set_registered_model_alias(releases, "policy-forged", served)

    # A: the copy's source is the candidate's version (MLflow's copy: its logged model's files)
    original = client.get_model_version(releases, served)
    copy = client.create_model_version(
        releases,
        source=f"models:/{other.model}/{other.version}",
        tags=dict(original.tags),
        description=original.description,
    )
    copied = str(copy.version)
    client.set_model_version_tag(releases, served, "dp.status", "failed")
    code, outcome = _set(operator, "forged", "--rerun")
    reasons = outcome.get("reasons", [])
    assert code == 2 and outcome["status"] == "refused", outcome
    assert (outcome["version"], outcome["reused"]) == (copied, True), outcome
    assert "reads its files from" in reasons[0] and "signed manifest" in reasons[0], reasons
    assert _aliases(stack)["policy-forged"] == served
    refused = consumer.dpmerge("verify", f"models:/{releases}/{copied}")
    assert refused.returncode == 2 and "reads its files from" in one_line(refused)
    client.set_model_version_tag(releases, copied, "dp.status", "failed")
    client.set_model_version_tag(releases, served, "dp.status", "ready")

    # E, C, D: the operator's own S3 key writes requests only, and malformed ones (a bad
    # quarantine key, a key of another shape, a 200,000-deep array) are each one recorded
    # rejection naming the field; the policy then runs as before
    own = _s3(stack, StackRole.OPERATOR)
    state = stack.config.state_bucket
    evil = f"quarantine/{other.model}/evil.json"
    with pytest.raises(ClientError, match="AccessDenied"):
        own.put_object(Bucket=state, Key=evil, Body=b"{}")
    deep = b"[" * 200_000 + b"]" * 200_000
    malformed = {
        f"inbox/{evil}": (b'{"model": [[[]]]}', "key"),
        "inbox/policies/%2E%2E/x/y.json": (b"{}", "key"),
        "inbox/policies/forged/20261206T000000Z-00000000000000aa.json": (deep, "body"),
    }
    for key, (body, _) in malformed.items():
        own.put_object(Bucket=state, Key=key, Body=body)
    for key, (_, field) in malformed.items():
        handled = inbox.wait(store, key, timeout_s=120)
        assert handled["status"] == "rejected" and handled["rejected"]["field"] == field, handled

    # K: refused by `policy set` before anything is stored
    history = operator.dpmerge("policy", "history", "forged", "--json")
    for bad in (("--delta", "0.5"), ("--target-epsilon", "1_0")):
        done = operator.dpmerge("policy", "set", "--name", "forged", *bad)
        assert done.returncode == 2 and one_line(done), done.stdout + done.stderr
    assert operator.dpmerge("policy", "history", "forged", "--json").stdout == history.stdout

    code, outcome = _set(operator, "forged", "--rerun")
    assert code == 0 and outcome["status"] == "unchanged", outcome
    assert outcome["version"] == served and _aliases(stack)["policy-forged"] == served
    assert consumer.dpmerge("verify", alias).returncode == 0

    # I: the served weights swapped by the store's admin, then a rerun: never "unchanged"
    s3.put_object(Bucket=bucket, Key=served_weights, Body=candidate_weights)
    try:
        code, outcome = _set(operator, "forged", "--rerun")
    finally:
        s3.put_object(Bucket=bucket, Key=served_weights, Body=genuine)
    assert code == 2 and outcome["status"] == "refused", outcome
    assert (outcome["revoked_version"], outcome["serving"]) == (served, "revoked"), outcome
    assert "weights.safetensors" in outcome["reasons"][0], outcome
    assert "policy-forged" not in _aliases(stack)
    assert consumer.dpmerge("verify", alias).returncode == 2
    code, outcome = _set(operator, "forged", "--rerun")  # restored: served again
    assert code == 0 and outcome["status"] == "promoted", outcome
    assert consumer.dpmerge("verify", alias).returncode == 0


FACTORY = """import math
from torch import nn
def mlp(input_shape, classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 32), nn.ReLU(),
                         nn.Linear(32, classes))
"""


@contextlib.contextmanager
def _own_folder(stack: PolicyStack) -> Iterator[Path]:
    """A folder outside the repository holding a Parquet table (digits, one row a person, a
    ``person`` unit column), its spec and a model factory: the workers' user may read it (one
    ACL entry, as an administrator grants it: docs/stack.md#your-data-on-the-stack)."""
    from sklearn.datasets import load_digits

    folder = Path(tempfile.mkdtemp(prefix="dpmerge-own-"))
    try:
        frame = load_digits(as_frame=True).frame
        frame.insert(0, "person", [f"p{i:05d}" for i in range(len(frame))])
        frame.to_parquet(folder / "digits.parquet")
        spec = {
            "path": "digits.parquet",
            "label": "target",
            "classes": list(range(10)),
            "features": [c for c in frame.columns if c.startswith("pixel_")],
            "unit": "person",
            "split_key": "stack-test-split-key",
        }
        (folder / "table.json").write_text(json.dumps(spec))
        (folder / "ownmodels.py").write_text(FACTORY)
        _grant_workers(stack, folder)
        yield folder
    finally:
        shutil.rmtree(folder)


def _grant_workers(stack: PolicyStack, folder: Path) -> None:
    """Let the workers' user (where the stack runs them as one) read ``folder``."""
    user = supervised_user(stack.config)
    if user is not None:
        subprocess.run(["setfacl", "-R", "-m", f"u:{user}:rX", str(folder)], check=True)


def _opacus_import(folder: Path, data: Any) -> dict[str, str]:
    """A candidate of the factory trained with plain Opacus on the table's training rows and
    saved by ``PrivacyEngine.save_checkpoint``, and its profile: an ``imports`` entry."""
    from opacus import PrivacyEngine

    from dpmerge.models import build_model, model_spec

    torch.manual_seed(0)
    model = build_model(model_spec("ownmodels:mlp", data, model_path=str(folder)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    rows = torch.utils.data.TensorDataset(data.train.features, data.train.labels)
    engine = PrivacyEngine(accountant="prv")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=torch.utils.data.DataLoader(rows, 64),
        noise_multiplier=0.8, max_grad_norm=1.0,
    )  # fmt: skip
    for _ in range(3):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    engine.save_checkpoint(path=folder / "opacus.pt", module=model, optimizer=optimizer)
    profile = {
        "profile": "opacus", "clip_norm": 1.0, "learning_rate": 0.5, "expected_batch_size": 64.0,
        "optimizer": "sgd", "sampling": "poisson", "neighbouring": "add_or_remove_one",
        "initialisation": "seed-0",  # build_model's seed 0, where the deployment's runs start
    }  # fmt: skip
    (folder / "opacus-profile.json").write_text(json.dumps(profile))
    return {
        "name": "opacus-elsewhere",
        "weights": str(folder / "opacus.pt"),
        "profile": str(folder / "opacus-profile.json"),
        "attested_by": "the stack test's Opacus run",
    }


def test_your_table_and_factory_train_on_the_workers_and_a_policy_serves_their_merge(
    stack: PolicyStack, operator: Shell, consumer: Shell
) -> None:
    """Bring your own, on the stack: a Parquet table and a model factory in a folder outside
    the repository are trained by the ``train-candidates`` deployment on the ``cpu`` worker
    (two noise levels), with a third candidate trained here with plain Opacus and imported from
    its checkpoint; a policy merges them, the release is served, verified by the consumer and
    answers ``mlflow models serve`` at the accuracy its card states."""
    with _own_folder(stack) as folder:
        spec_file = str(folder / "table.json")
        data = load_dataset("table", spec_file)
        imported = _opacus_import(folder, data)
        _grant_workers(stack, folder)  # the checkpoint and profile written since
        with prefect_client(stack.config) as client:
            deployment = client.read_deployment_by_name("train-candidates/train-candidates")
            created = client.create_flow_run_from_deployment(
                deployment.id,
                parameters={
                    "dataset": "table", "data_root": spec_file, "model": "ownmodels:mlp",
                    "model_path": str(folder), "noise_multipliers": [1.0, 3.0], "epochs": 3,
                    "batch_size": 64, "learning_rate": 0.5, "deployment": None,
                    "frontier_report": False, "imports": [imported],
                },
            )  # fmt: skip
        finished = wait_run(stack.config, created.id)
        assert finished.state.is_completed(), finished.state.message
        found = [
            v
            for v in _mlflow(stack).search_model_versions("tags.`dp.role` = 'candidate'")
            if v.name != stack.candidates_model
        ]
        assert {v.tags["dp.status"] for v in found} == {"ready"}, found
        assert "opacus-elsewhere" in {v.tags["dp.candidate"] for v in found}, found
        assert len({v.name for v in found}) == 1 and len(found) == 3, found
        target = max(float(v.tags["dp.epsilon"]) for v in found) * 1.2
        done = operator.dpmerge(
            "policy", "set", "--name", "own", "--dataset", "table", "--model", "ownmodels:mlp",
            "--data-root", spec_file, "--target-epsilon", f"{target:.6f}", "--delta", "1e-5",
            "--wait", str(RUN_TIMEOUT_S), "--json", timeout=RUN_TIMEOUT_S + 120,
        )  # fmt: skip
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        outcome = json.loads(done.stdout.strip().splitlines()[-1])
        assert done.returncode == 0 and outcome["status"] == "promoted", outcome
        assert outcome["epsilon"] <= target
        releases = found[0].name.removesuffix("-candidates") + "-releases"
        assert _mlflow(stack).get_registered_model(releases).aliases["policy-own"] == str(
            outcome["version"]
        )
        verified = consumer.dpmerge("verify", "@policy-own", "--json")
        assert verified.returncode == 0, verified.stderr
        assert json.loads(verified.stdout)["version"] == outcome["version"]
        card = _card(stack, outcome["version"], releases)
        weights = outcome.get("weights") or ()
        used = {n for n, w in zip(outcome["candidates"], weights, strict=True) if w > 0} | {
            m for rung in outcome.get("rungs") or () for m in rung["members"]
        }
        print(f"\nyour data on the stack: {outcome['method']} of {sorted(used)}")
        assert "opacus-elsewhere" in used  # the import is in the release: its card says so
        description = _mlflow(stack).get_model_version(releases, outcome["version"]).description
        shown = operator.dpmerge("ledger", "show", "--source", "own", "--json")
        assert shown.returncode == 0, shown.stderr
        (ledger,) = json.loads(shown.stdout)["ledgers"]  # your data's own ledger, counted
        assert ledger["releases"] == 1 and ledger["epsilon"] >= outcome["epsilon"], ledger
        assert f"**{imported['attested_by']}" in description or imported["attested_by"] in (
            description
        ), description[:3000]
        server, url = _serve(consumer, f"models:/{releases}@policy-own")
        try:
            rows = data.test.features.numpy()
            answer = requests.post(
                f"{url}/invocations", json={"inputs": rows.tolist()}, timeout=120
            )
            assert answer.ok, answer.text[:2000]
            predicted = np.asarray(answer.json()["predictions"]).argmax(axis=1)
        finally:
            _stop(server)
        accuracy = float((predicted == data.test.labels.numpy()).mean())
        print(
            f"\nyour data on the stack: ε {outcome['epsilon']:.4f}, served accuracy {accuracy:.4f}"
        )
        n, epsilon = len(data.test), card["rows"]["test"]["epsilon"]
        tolerance = 1 / n + math.log(1e9) / (n * epsilon)  # as _estimate_tolerance
        assert abs(accuracy - card["accuracy"]["test_accuracy"]) <= tolerance


def _stored_run(stack: PolicyStack, name: str, target: float) -> tuple[dict[str, Any], float]:
    """A policy version stored as the workflow (the operator's command needs MLflow to check
    it), its outcome and the seconds to it."""
    store = Workspace.from_env().state()
    payload = {"name": name, "target_epsilon": target, "target_delta": DELTA}
    payload |= {"dataset": "digits", "model": "logreg"}
    change = stored_policies.set_policy(store, name, payload, source="test")
    started = time.monotonic()
    outcome = wait_for_outcome(store, change.version, RUN_TIMEOUT_S)
    assert outcome is not None, f"no outcome for {name} within {RUN_TIMEOUT_S} s"
    return outcome, time.monotonic() - started


def _mlflow_pid(stack: PolicyStack) -> int:
    (mlflow,) = [s for s in devstack.status(stack.config) if s.name == "mlflow"]
    assert mlflow.pid is not None
    return mlflow.pid


def _warm_children(stack: PolicyStack) -> list[int]:
    """The processes this stack's cpu worker's warm server (``flows/warm.py --serve``, its
    socket under the worker's directory) forked for the flow runs now running. A fork keeps
    the server's command line: the server is the one whose parent is no such process. Other
    stacks' warm servers (tests beside this one) are left alone."""
    mine = str(worker_dir(stack.config)).encode() + b"/"
    warm: dict[int, int] = {}  # pid -> parent pid
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            serving = argv[argv.index(b"--serve") + 1] if b"--serve" in argv[:-1] else b""
            if proc.name.isdigit() and b"flows.warm" in argv and serving.startswith(mine):
                parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
                warm[int(proc.name)] = int(parent)
    servers = {pid for pid, parent in warm.items() if parent not in warm}
    return sorted(set().union(*(descendants(s) for s in servers)) - servers)


def test_a_run_killed_mid_flight_is_applied_again_by_the_dispatcher(stack: PolicyStack) -> None:
    """SIGKILL of a running policy run (its worker-side process and the warm child running it):
    Prefect marks it Crashed; the dispatcher records that outcome and stores the fields again
    as a new version, whose run serves a release meeting them — nobody reruns anything."""
    from prefect.client.schemas.objects import StateType

    from flows.dispatch import RESCUE_SOURCE

    store = Workspace.from_env().state()
    fields = {"target_epsilon": stack.epsilons[1] * 1.2, "target_delta": DELTA,
              "dataset": "digits", "model": "logreg", "method": "lc"}  # fmt: skip
    number = stored_policies.set_policy(store, "rescue", fields, source="test").version.version
    deadline = time.monotonic() + 120
    while (record := stored_policies.dispatched(store, "rescue", number)) is None:
        assert time.monotonic() < deadline, "not dispatched"
        time.sleep(0.2)
    with prefect_client(stack.config) as client:
        run_id = record["flow_run"]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while (run := client.read_flow_run(run_id)).state.type != StateType.RUNNING:
            assert not run.state.is_final(), run.state
            assert time.monotonic() < deadline, run.state
            time.sleep(0.1)
        killed = _warm_children(stack)
        if run.infrastructure_pid:
            killed.append(int(str(run.infrastructure_pid).rsplit(":", 1)[-1]))
        assert killed, "no process of the run found"
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # a loaded host can take minutes to see the exit; a run the kill missed would end
        # Completed, not Crashed, so the wait proves nothing by timing out
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (run := client.read_flow_run(run_id)).state.is_final():
            assert time.monotonic() < deadline, run.state
            time.sleep(0.5)
        assert run.state.type == StateType.CRASHED, run.state
    lost = stored_policies.read_version(store, "rescue", number)
    crashed = wait_for_outcome(store, lost, 120)
    assert crashed is not None and (crashed["status"], crashed["state"]) == ("failed", "Crashed")
    again = stored_policies.read_version(store, "rescue", number + 1)
    assert again is not None and again.source.startswith(RESCUE_SOURCE), again
    assert again.policy == lost.policy
    outcome = wait_for_outcome(store, again, RUN_TIMEOUT_S)
    assert outcome is not None and outcome["status"] in ("promoted", "unchanged"), outcome
    assert outcome["serving"] == "serving", outcome
    assert _aliases(stack)["policy-rescue"] == outcome["serving_version"]


def test_a_hung_then_a_dead_mlflow_fails_runs_within_a_bounded_time(stack: PolicyStack) -> None:
    """MLflow frozen (SIGSTOP: it accepts connections and never answers), then stopped: each
    run ends ``failed`` within two minutes, and the alias stays. Last: MLflow stays down."""
    aliases = _aliases(stack)
    os.killpg(_mlflow_pid(stack), signal.SIGSTOP)
    try:
        hung, seconds = _stored_run(stack, "outage", stack.epsilons[2] * 1.9)
    finally:
        os.killpg(_mlflow_pid(stack), signal.SIGCONT)
    print(f"\nMLflow hung: {hung['status']} after {seconds:.0f} s: {hung.get('reasons')}")
    assert hung["status"] == "failed" and seconds < 120, hung
    assert _aliases(stack) == aliases
    Supervisor(stack.config).stop("mlflow")  # down, and not restarted by supervisord
    dead, seconds = _stored_run(stack, "outage", stack.epsilons[2] * 1.8)
    print(f"MLflow down: {dead['status']} after {seconds:.0f} s: {dead.get('reasons')}")
    assert dead["status"] == "failed" and seconds < 120, dead
