"""``merge-on-policy``: a stored policy version → load candidates, calibrate, merge, evaluate,
count, register, serve (or keep the serving invariant). No training. The state machine is the
library's ``dpmerge.policy_merge.apply_policy``; this flow runs its steps as Prefect tasks
(``tasks.policy.STEPS``), holds the policy's lease while it does, records the outcome in the
release-state store and turns it into the run's state (docs/workflow.md#outcomes).

Its parameters are a policy's name and a stored version number: the dispatcher
(``flows/dispatch.py``) creates one run per new version, and ``dpmerge policy set`` runs it
in-process when there is no server. A version that does not exist or is not valid for this
registry ends as ``Rejected``, as do an alias another policy owns and a δ* not below 1/n of
the candidates' dataset; a record or state object that
fails verification ends as ``Refused``.

Final states: the state *type* says whether the policy is met — its alias serves a release
that meets this version — the *name* says how the run ended (Prefect emits
``prefect.flow-run.<name>``, which automations can match):

* promoted → Completed (exit 0); unchanged → Completed ``Unchanged`` (0);
* infeasible or not promoted (exit 3 or 4): Completed ``Infeasible``/``NotPromoted`` when the
  alias keeps a release that meets this version; else Failed — ``Revoked`` when this run
  revoked the alias, ``Noncompliant`` when the policy keeps a model that does not meet it,
  ``Infeasible``/``NotPromoted`` when the alias served nothing already;
* superseded (a later version of the policy) → Cancelled ``Superseded`` (5);
* rejected (no such version, a policy not valid for this registry, another policy's alias) →
  Failed ``Rejected`` (2); refused (a record or state object fails verification, a fixed-seed
  candidate; or the release to serve, reuse or keep is not its signed files and model, when
  the alias is also kept on a verified compliant release or revoked) → Failed ``Refused`` (2).

An outage (MLflow or S3 down or not answering in time) ends ``Failed`` with its outcome
``failed`` recorded where the store can still be reached, so ``policy set --wait`` reports it
(exit 1); ``Crashed`` or a ``Failed`` run without an outcome means a bug or a lost process,
and the dispatcher keeps the serving invariant for it (flows/dispatch.py).
Every outcome also becomes the Markdown artifact ``policy-<name>`` and an outcome object in
the state store.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.objects import State
from prefect.runtime import flow_run as current_run
from prefect.states import Cancelled, Completed, Failed

from dpmerge import policy_merge as pm
from dpmerge.errors import InputError, IntegrityError, OutageError, RefusalError
from dpmerge.policies import PolicyError, check_registered
from dpmerge.policy_merge import PolicyOutcome, Status
from dpmerge.policy_merge.verify import verify
from dpmerge.registry.catalog import open_catalog
from dpmerge.state import StateStore
from dpmerge.state import policies as stored_policies
from dpmerge.state.leases import lease
from dpmerge.state.policies import PolicyVersion
from dpmerge.vocabulary import ServingState
from flows.verify import emit
from tasks import policy as steps

FLOW_NAME = "merge-on-policy"
DEPLOYMENT = f"{FLOW_NAME}/{FLOW_NAME}"
REJECTED, REFUSED, FAILED = "Rejected", "Refused", "Failed"
LEASE_WAIT_S = 900.0
VERIFY_NICENESS = 10
"""How much lower the drift check after a run is scheduled than the next policy's run."""
NAMES = {
    Status.PROMOTED: "Completed",
    Status.UNCHANGED: "Unchanged",
    Status.INFEASIBLE: "Infeasible",
    Status.NOT_PROMOTED: "NotPromoted",
    Status.SUPERSEDED: "Superseded",
    Status.REFUSED: REFUSED,
}
STATUS_OF_STATE = {
    **{name: status.value for status, name in NAMES.items()},
    REJECTED: "rejected",
    REFUSED: "refused",
    FAILED: "failed",
}
"""The outcome a final state's name stands for (a run without its outcome document)."""
OUTCOME_JSON = re.compile(r"```json\n(.*?)\n```", re.DOTALL)


def run_name(version: PolicyVersion) -> str:
    """``policy-eu v3 ε*=2``: what a run of ``version`` is called."""
    return f"policy-{version.name} v{version.version} ε*={version.policy.target_epsilon:g}"


def state_of(outcome: PolicyOutcome) -> tuple[Any, str]:
    """The run's final state type and name for ``outcome`` (see the module docstring)."""
    if outcome.status == Status.SUPERSEDED:
        return Cancelled, NAMES[outcome.status]
    if outcome.status == Status.REFUSED:  # a release that is not its files is news, always
        return Failed, REFUSED
    if outcome.compliant:
        return Completed, NAMES[outcome.status]
    if outcome.revoked_version is not None:
        return Failed, "Revoked"
    if outcome.serving == ServingState.NONCOMPLIANT:
        return Failed, "Noncompliant"
    return Failed, NAMES[outcome.status]


def _artifact(key_name: str, title: str, lines: list[str], document: dict[str, Any]) -> None:
    key = re.sub(r"[^a-z0-9-]", "-", f"policy-{key_name}".lower())[:100]
    text = json.dumps(document, indent=2, default=str, ensure_ascii=False)
    body = [*lines, "", "```json", text, "```"]
    create_markdown_artifact(markdown="\n".join(body), key=key, description=title)


def outcome_from_markdown(markdown: str) -> dict[str, Any] | None:
    """The outcome document an artifact of this flow carries, its last JSON block (``None`` if
    none)."""
    found = OUTCOME_JSON.findall(markdown or "")
    return json.loads(found[-1]) if found else None


def _record(store: StateStore, name: str, version: int, document: dict[str, Any]) -> None:
    run = current_run.id
    stored_policies.record_outcome(store, name, version, document, str(run) if run else None)


def _finish(store: StateStore, outcome: PolicyOutcome, card: str = "") -> State:
    """The run's final state for ``outcome``, with its artifact and its stored outcome."""
    summary = outcome.summary()
    lines = [f"# Policy `{outcome.policy}` v{outcome.policy_version}: {outcome.status.value}"]
    lines += ["", summary, ""] + (["---", "", card] if card else [])
    make, name = state_of(outcome)
    document = {**outcome.to_dict(), "state": name}
    _artifact(outcome.policy, f"dpmerge policy {outcome.policy}: {outcome.status}", lines, document)
    _record(store, outcome.policy, int(outcome.policy_version or 0), document)
    logger = get_run_logger()
    (logger.info if make is Completed else logger.warning)(summary)
    return make(name=name, message=summary, data=document)


def _stopped(store: StateStore, name: str, version: int, state: str, error: Exception) -> State:
    """A run that stopped before applying anything: ``Rejected`` (bad input), ``Refused``
    (failed verification) or ``Failed`` (an outage: its outcome is recorded if the store
    answers)."""
    status = STATUS_OF_STATE[state]
    message = f"policy {name} v{version} {status}: {error}"
    document = {"status": status, "state": state, "policy": name, "policy_version": version}
    document["reasons"] = [str(error)]
    _artifact(name, f"dpmerge policy {name}: {status}", [message], document)
    try:
        # stored, even if unreadable: its history shows how it ended
        if store.backend.read(stored_policies.version_key(name, version)) is not None:
            _record(store, name, version, document)
    except OutageError as unrecorded:  # the store itself is down: the run's state still says
        get_run_logger().error("outcome not recorded: %s", unrecorded)
    get_run_logger().error(message)
    return Failed(name=state, message=message, data=document)


def _yield_cpu() -> None:
    """Lower this process's priority if a worker started it for this run alone: what is left
    of the run is the drift check, after the alias moved, and the next policy's run should not
    wait for it. In-process runs (the CLI, tests) keep their priority."""
    if current_run.id and os.environ.get("PREFECT__FLOW_RUN_ID") == str(current_run.id):
        os.nice(VERIFY_NICENESS)


@flow(name=FLOW_NAME, persist_result=False)
def merge_on_policy(policy: str, version: int) -> State:
    """Apply version ``version`` of the stored policy ``policy`` (see the module docstring)."""
    workspace = pm.Workspace.from_env()
    store = workspace.state()
    try:
        stored = stored_policies.read_version(store, policy, version)
        if stored is None:
            raise PolicyError(f"policy {policy!r} has no stored version {version}")
        check_registered([stored.policy], open_catalog(workspace.tracking_uri).inventory())
    except InputError as error:
        return _stopped(store, policy, version, REJECTED, error)
    except OutageError as error:
        return _stopped(store, policy, version, FAILED, error)
    get_run_logger().info(
        "policy %s v%d: target (%g, %g), method %s, gate %s; registry %s, state %s",
        policy,
        version,
        stored.policy.target_epsilon,
        stored.policy.target_delta,
        stored.policy.method,
        stored.policy.gating_bound,
        workspace.tracking_uri,
        store.where,
    )
    workspace.use_caches()
    run = str(current_run.id) if current_run.id else None
    try:
        with lease(store, policy, LEASE_WAIT_S):
            applied = pm.apply_policy(stored, workspace, run=run, steps=steps.STEPS)
    except InputError as error:  # another policy's alias; δ ≥ 1/n of the candidates
        return _stopped(store, policy, version, REJECTED, error)
    except (IntegrityError, RefusalError) as error:
        return _stopped(store, policy, version, REFUSED, error)
    except OutageError as error:
        return _stopped(store, policy, version, FAILED, error)
    final = _finish(store, applied.outcome, applied.card)
    if applied.dataset is not None:  # drift of this dataset, reported (and repaired) now
        _yield_cpu()
        emit(verify(workspace, repair=True, dataset=applied.dataset))
    return final
