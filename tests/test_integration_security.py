"""The red-team reproductions of issue 9 on the real local stack (S3 on disk, MLflow on S3, Prefect
server, workers), driven by ``dpmerge.policy.updated`` events: a forged record, an event dated
ten years ahead, an alias hijack and a lost ledger must all be refused; concurrent in-process
promotions keep every release in the S3 ledger; an RS release is drawn once; an MLflow outage
fails the run within a bounded time (fault injected by the pid the stack recorded).

Candidates are trained in this process and registered in the stack's MLflow with the session's
key, which the workers inherit (tests/conftest.py). Figures are printed (``-s``)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from deployed import deployed_stack
from factories import DELTA, train_digits
from mlflow import MlflowClient
from servers import workflow_prefect

import devstack as stack_mod
from dpmerge import policy_merge as pm
from dpmerge.policies import Policy, policy_from_dict
from dpmerge.registry import candidate_content_hash
from flows import runtime

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack_mod.StackConfig]:
    with deployed_stack(tmp_path_factory) as config:
        yield config


@pytest.fixture(scope="module")
def trained(stack: stack_mod.StackConfig, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Three digits candidates in the stack's registry; their ε, ascending."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("candidates")
    registry = pm.Workspace.from_env().registry()
    epsilons = []
    for sigma in (1.0, 1.6, 3.0):
        path = train_digits(root, sigma)
        registry.register_candidate(path)
        epsilons.append(json.loads((path / "record.json").read_text())["privacy"]["epsilon"])
    return sorted(epsilons)


def _policy(**fields: Any) -> Policy:
    base = {"name": "eu", "target_delta": DELTA, "dataset": "digits", "model": "logreg"}
    return policy_from_dict({**base, **fields})


def _emit(stack: stack_mod.StackConfig, policy: Policy, occurred: datetime | None = None) -> str:
    """Send the policy's event (with a chosen ``occurred``, the sender's claim)."""
    if occurred is None:
        return runtime.emit_policy_event(
            policy.event_payload(), policy.resource_id, policy.name, url=stack.prefect_api_url
        )
    from prefect.events import Event
    from prefect.events.clients import PrefectEventsClient
    from prefect.utilities.asyncutils import run_coro_as_sync

    event = Event(
        event=runtime.EVENT,
        occurred=occurred,
        resource={"prefect.resource.id": policy.resource_id, "prefect.resource.name": policy.name},
        payload=policy.event_payload(),
    )

    async def send() -> None:
        async with PrefectEventsClient(api_url=stack.prefect_api_url, checkpoint_every=1) as client:
            await client.emit(event)

    with workflow_prefect(stack):  # the events client reads the auth string from settings
        run_coro_as_sync(send())
    return str(event.id)


FINAL = {
    "Completed",
    "Unchanged",
    "Infeasible",
    "NotPromoted",
    "Superseded",
    "Rejected",
    "Failed",
    "Crashed",
    "Cancelled",
}
"""The final states' names a policy run can end in (flows/merge.py)."""


def _run(stack: stack_mod.StackConfig, event_id: str) -> runtime.PolicyRun:
    run = runtime.wait_for_policy_run(event_id, RUN_TIMEOUT_S, url=stack.prefect_api_url)
    assert run.state in FINAL, f"no finished run for event {event_id}: {run.state}"
    return run


def _completed(run: runtime.PolicyRun) -> bool:
    return run.state == "Completed"


def _failed(run: runtime.PolicyRun, because: str) -> bool:
    """Failed (or rejected, for bad input) with ``because`` in the message."""
    return run.state in ("Failed", "Rejected") and because in (run.message or "")


def _client(stack: stack_mod.StackConfig) -> MlflowClient:
    return MlflowClient(stack.mlflow_url)


def _pool() -> pm.CandidatePool:
    return pm.find_candidates(pm.Workspace.from_env().registry(), "digits", "logreg")


def _aliases(stack: stack_mod.StackConfig) -> dict[str, str]:
    model = _client(stack).get_registered_model(_pool().merged_model)
    return {k: str(v) for k, v in model.aliases.items()}


def _release_versions(stack: stack_mod.StackConfig) -> int:
    return len(_client(stack).search_model_versions(f"name = '{_pool().merged_model}'"))


def _s3(stack: stack_mod.StackConfig) -> Any:
    """The stack's own S3 identity (an attacker with the store's keys)."""
    config = stack.s3_config()
    return boto3.client(
        "s3",
        endpoint_url=stack.s3_url,
        aws_access_key_id=config.access_key_id,
        aws_secret_access_key=config.secret_access_key,
        region_name=config.region,
    )


def test_1_a_policy_event_promotes_and_the_rs_draw_is_stored_once(stack, trained) -> None:
    first = _run(stack, _emit(stack, _policy(target_epsilon=trained[1] * 1.05, method="rs")))
    assert _completed(first), first.message
    again = _run(stack, _emit(stack, _policy(target_epsilon=trained[1] * 1.05, method="rs")))
    assert again.state == "Unchanged", again.message  # the same release: reused, no new draw
    audit = _s3(stack).list_objects_v2(Bucket=stack.audit_bucket).get("Contents", [])
    rs = list(_client(stack).search_model_versions(f"name = '{_pool().merged_model}'"))
    extra = len(audit) - len(rs)
    print(f"\nRS releases {len(rs)}, draw records {len(audit)}: extra draws {extra}")
    assert len(audit) == len(rs) == 1 and _aliases(stack) == {"policy-eu": rs[0].version}


def test_2_a_forged_record_is_refused(stack, trained, tmp_path: Path) -> None:
    """σ × 10 in a candidate's record.json in S3 and the content-hash tag rewritten to match:
    the run fails naming the repair; nothing registered, the alias stays."""
    pool, s3, client = _pool(), _s3(stack), _client(stack)
    version = client.get_model_version(pool.registered_model, pool.versions[0])
    model_id = version.source.split("/models/")[1].split("/")[0]
    experiment = client.get_experiment_by_name("dpmerge-candidates").experiment_id
    keys = [
        o["Key"]
        for o in s3.list_objects_v2(Bucket=stack.bucket, Prefix=f"mlartifacts/{experiment}/")[
            "Contents"
        ]
        if f"/models/{model_id}/artifacts/extra_files/" in o["Key"]
    ]
    for key in keys:
        (tmp_path / key.rsplit("/", 1)[1]).write_bytes(
            s3.get_object(Bucket=stack.bucket, Key=key)["Body"].read()
        )
    (record_key,) = [k for k in keys if k.endswith("/record.json")]
    genuine = (tmp_path / "record.json").read_bytes()
    document = json.loads(genuine)
    document["record"]["noise_multiplier"] *= 10
    (tmp_path / "record.json").write_text(json.dumps(document))
    s3.put_object(Bucket=stack.bucket, Key=record_key, Body=(tmp_path / "record.json").read_bytes())
    forged_hash = candidate_content_hash(tmp_path)
    original_hash = version.tags["dp.content_hash"]
    client.set_model_version_tag(
        pool.registered_model, version.version, "dp.content_hash", forged_hash
    )
    aliases, versions = _aliases(stack), _release_versions(stack)
    try:
        run = _run(stack, _emit(stack, _policy(target_epsilon=trained[2] * 1.5, method="lc")))
        print(f"\nforged record: run {run.state}: {run.message}")
        assert _failed(run, "fails verification")
        assert _aliases(stack) == aliases and _release_versions(stack) == versions
    finally:  # put the genuine record back for the next tests
        s3.put_object(Bucket=stack.bucket, Key=record_key, Body=genuine)
        client.set_model_version_tag(
            pool.registered_model, version.version, "dp.content_hash", original_hash
        )


def test_3_an_event_from_the_future_is_refused_and_later_policies_apply(stack, trained) -> None:
    future = datetime.now(UTC) + timedelta(days=3650)
    aliases = _aliases(stack)
    run = _run(stack, _emit(stack, _policy(target_epsilon=trained[2] * 2, method="lc"), future))
    print(f"\nfuture event: run {run.state}: {run.message}")
    assert _failed(run, "later than its arrival")
    assert _aliases(stack) == aliases
    later = _run(stack, _emit(stack, _policy(target_epsilon=trained[2] * 1.5, method="lc")))
    assert _completed(later), later.message
    assert _aliases(stack)["policy-eu"] != aliases["policy-eu"]  # the later policy applied


def test_4_an_alias_hijack_is_refused(stack, trained) -> None:
    aliases, versions = _aliases(stack), _release_versions(stack)
    for target in (trained[2] * 3, trained[0] / 2):  # a promotion and a revocation
        hijack = _policy(name="evil", alias="policy-eu", target_epsilon=target, method="lc")
        run = _run(stack, _emit(stack, hijack))
        print(f"\nalias hijack (ε* = {target:.3g}): run {run.state}: {run.message}")
        assert run.state == "Rejected" and "belongs to policy 'eu'" in (run.message or "")
    assert _aliases(stack) == aliases and _release_versions(stack) == versions


def test_5_a_lost_ledger_fails_closed_and_is_rebuilt(stack, trained) -> None:
    s3 = _s3(stack)
    key = "ledger/releases.json"
    saved = s3.get_object(Bucket=stack.bucket, Key=key)["Body"].read()
    s3.delete_object(Bucket=stack.bucket, Key=key)
    aliases, versions = _aliases(stack), _release_versions(stack)
    capped = _policy(target_epsilon=trained[2] * 2.5, method="rs", cumulative_epsilon_cap=100.0)
    run = _run(stack, _emit(stack, capped))
    print(f"\nlost ledger: run {run.state}: {run.message}")
    assert _failed(run, "ledger rebuild")
    assert _aliases(stack) == aliases and _release_versions(stack) == versions
    added = pm.rebuild_ledger(pm.Workspace.from_env())
    rebuilt = s3.get_object(Bucket=stack.bucket, Key=key)["Body"].read()
    assert len(added) == len(json.loads(saved)["releases"])
    assert {r["release_id"] for r in json.loads(rebuilt)["releases"]} == {
        r["release_id"] for r in json.loads(saved)["releases"]
    }
    assert _completed(_run(stack, _emit(stack, capped)))


def test_6_concurrent_promotions_keep_every_release_in_the_s3_ledger(stack, trained) -> None:
    """Three policies applied at once in this process (the issue's race): all three releases
    end in the ledger and every promoted version is marked released."""
    workspace = pm.Workspace.from_env()
    targets = {"race-a": trained[1] * 1.05, "race-b": trained[1] * 1.3, "race-c": trained[2] * 1.2}
    start = threading.Barrier(len(targets))
    outcomes: dict[str, Any] = {}

    def apply(name: str) -> None:
        start.wait()
        outcomes[name] = pm.apply_policy(
            _policy(name=name, target_epsilon=targets[name], method="rs"), workspace
        ).outcome

    threads = [threading.Thread(target=apply, args=(n,)) for n in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {o.status for o in outcomes.values()} == {pm.Status.PROMOTED}, outcomes
    ledger = json.loads(
        _s3(stack).get_object(Bucket=stack.bucket, Key="ledger/releases.json")["Body"].read()
    )
    recorded = {r["release_id"] for r in ledger["releases"]}
    client = _client(stack)
    hashes = {
        client.get_model_version(o.merged_model, o.version).tags["dp.content_hash"]
        for o in outcomes.values()
    }
    print(
        f"\nconcurrent promotions: {len(hashes)} releases, {len(hashes & recorded)} in the ledger"
    )
    assert hashes <= recorded


def _mlflow_pid(stack: stack_mod.StackConfig) -> int:
    (mlflow,) = [s for s in stack_mod.status(stack) if s.name == "mlflow"]
    assert mlflow.pid is not None
    return mlflow.pid


def test_7_a_hung_mlflow_fails_the_run_within_a_bounded_time(stack, trained) -> None:
    """MLflow frozen (SIGSTOP to the pid the stack recorded: it accepts connections and never
    answers): the run fails clearly within two minutes and frees the slot; once MLflow answers
    again the next event applies."""
    aliases = _aliases(stack)
    os.killpg(_mlflow_pid(stack), signal.SIGSTOP)
    try:
        run = _run(stack, _emit(stack, _policy(target_epsilon=trained[2] * 1.9, method="lc")))
    finally:
        os.killpg(_mlflow_pid(stack), signal.SIGCONT)
    seconds = run.seconds
    assert seconds is not None
    print(f"\nMLflow hung: run {run.state} after {seconds:.0f} s: {run.message[:160]}")
    assert run.state == "Failed" and seconds < 120
    assert _aliases(stack) == aliases
    after = _run(stack, _emit(stack, _policy(target_epsilon=trained[2] * 1.9, method="lc")))
    assert _completed(after), after.message


def test_8_an_mlflow_outage_fails_the_run_within_a_bounded_time(stack, trained) -> None:
    """MLflow killed (by the pid the stack recorded) before an event: the run fails clearly in
    well under a minute and frees the slot. Last: MLflow stays down."""
    os.killpg(_mlflow_pid(stack), signal.SIGKILL)
    started = time.monotonic()
    run = _run(stack, _emit(stack, _policy(target_epsilon=trained[2] * 1.7, method="lc")))
    seconds = run.seconds
    assert seconds is not None
    print(
        f"\nMLflow down: run {run.state} after {seconds:.0f} s (event → final "
        f"{time.monotonic() - started:.0f} s): {(run.message or '')[:200]}"
    )
    assert run.state == "Failed" and seconds < 120
