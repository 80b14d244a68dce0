"""The policy dispatcher: every stored policy version becomes one run of ``merge-on-policy``
(docs/workflow.md#policy-dispatch).

Operators change policies by writing versions to the release-state store (``dpmerge policy
set``); they hold no Prefect credentials, so they cannot start arbitrary runs. The dispatcher, a
workflow process (the stack supervises one), polls the store and, for the newest version of
each policy that has no run yet:

* creates a flow run of the ``merge-on-policy`` deployment with parameters ``{policy,
  version}`` and the idempotency key ``policy-<name>-v<version>`` — Prefect returns the same
  run for the same key, so a retried or concurrent dispatch never makes two, and an answer lost
  on the way (a 503) is simply retried at the next poll;
* records the run in the store (``dispatch/<name>/<version>.json``), where ``dpmerge policy
  set`` waits for it: the operator learns that the change became a run, or fails loudly;
* emits ``dpmerge.policy.updated`` (resource ``dpmerge.policy.<name>``) for automations and the
  event feed — a notification only: nothing is triggered by it.

An older version that was never dispatched is recorded as superseded at once (its outcome says
by which version): only the newest version of a policy runs.

Operators write requests, never state (:mod:`dpmerge.state.inbox`): each poll first records
every new request under ``inbox/`` into the canonical tree, which only the workflow writes — the
next policy version, a quarantine record, or a rejection naming the key and the field. What is
in the canonical tree is read as untrusted input too (:mod:`dpmerge.state.rejections`): each
version within the store's size and depth caps, against the strict schema and its own key,
before anything is created; one that fails gets a ``Rejected`` outcome naming the key and the
field (``dpmerge policy history``), is recorded as handled so it is never read again, and never
delays another policy. Keys of another shape under ``policies/`` or ``quarantine/``, and
quarantine records that are not exactly one, are recorded under ``rejected/`` (``dpmerge policy
ls``); each rejection also emits ``dpmerge.policy.rejected``.

A run that ends ``Failed`` (a bug), ``Crashed`` (its process lost: killed, out of memory, its
worker gone) or ``Cancelled`` (by hand) without recording its outcome leaves its alias as it
was, which may miss the newest version, and ``dpmerge policy set --wait`` without an outcome to
read. Every :data:`RESCUE_EVERY_S` the dispatcher looks at the run of each policy's newest
version; if it ended without an outcome, the dispatcher, under the policy's lease (the next
round when the lost run's lease has not expired yet), makes the alias meet that version — it
revokes, or flags under ``on_noncompliant: keep`` (:func:`dpmerge.policy_merge.promotion.hold`,
docs/design.md#release-state) — and records the outcome (``failed``, the state's name, what
was done: ``policy history`` and ``--wait`` show it). A ``Failed`` or ``Crashed`` run is then
applied again: the same fields stored as a new version (``set_policy(rerun=True)``, source
:data:`RESCUE_SOURCE`), which the next poll dispatches — a rerun reuses what the lost run
counted or drew. At most :data:`MAX_RESCUES` in a row: a run that fails every time is left to
a person (``verify-state`` reports the policy); a cancelled run is not applied again.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpmerge.errors import DPMergeError
from dpmerge.policies import PolicyError
from dpmerge.state import StateStore, SupersededError, inbox, rejections
from dpmerge.state import policies as stored_policies
from dpmerge.state import quarantine as stored_quarantine
from dpmerge.state.leases import LeaseTimeoutError, lease
from dpmerge.state.policies import PolicyVersion
from dpmerge.state.rejections import Rejection

EVENT = "dpmerge.policy.updated"
REJECTED_EVENT = "dpmerge.policy.rejected"

POLL_S = 0.5
DEPLOYMENT = "merge-on-policy/merge-on-policy"
RESCUE_EVERY_S = 10.0
MAX_RESCUES = 2
RESCUE_SOURCE = "dispatcher: applied again, its run ended without an outcome"
CANCELLED = "Cancelled"
ENDED = {"FAILED": "Failed", "CRASHED": "Crashed", "CANCELLED": CANCELLED}
"""The final states (Prefect's ``StateType`` values) a run can reach without recording its
outcome, and their names."""
log = logging.getLogger("dpmerge.dispatch")


@dataclass(frozen=True)
class Pending:
    """A stored policy version with no run yet."""

    name: str
    version: int


def pending(store: StateStore) -> list[Pending]:
    """Every stored version (a key of the right shape) with no dispatch record yet, by name
    and version."""
    done = {
        stored_policies.parse_key(key.replace("dispatch/", stored_policies.PREFIX, 1))
        for key in store.keys("dispatch/")
    }
    return [Pending(*p) for p in stored_policies.stored_keys(store) if p not in done]


def reject(store: StateStore, item: Pending, error: PolicyError) -> Rejection:
    """Record version ``item`` as handled and rejected: its outcome names the key and field."""
    key = stored_policies.version_key(item.name, item.version)
    field = error.field or "policy"
    reason = str(error).removeprefix(f"{store.where}/{key}: ").removeprefix(f"field {field!r}: ")
    rejection = Rejection(key, field, reason)
    if stored_policies.record_dispatch(
        store, item.name, item.version, {"rejected": rejection.to_dict()}
    ):
        stored_policies.record_outcome(
            store,
            item.name,
            item.version,
            {
                "status": "rejected",
                "state": "Rejected",
                "policy": item.name,
                "policy_version": item.version,
                "rejected": rejection.to_dict(),
                "reasons": [rejection.line()],
            },
            None,
        )
    return rejection


def strays(store: StateStore, valid: set[str]) -> list[Rejection]:
    """Objects under the operators' prefixes not yet recorded that are not requests: keys of
    another shape under ``policies/`` or ``quarantine/``, quarantine records that are not
    exactly one (``valid``: quarantine keys already found valid, not read again; extended)."""
    done = rejections.recorded_keys(store) | valid
    found = [
        Rejection(key, "key", f"not {stored_policies.PREFIX}<name>/<version>.json")
        for key in stored_policies.malformed_keys(store)
        if rejections.record_key(key) not in done
    ]
    for key in store.keys(stored_quarantine.PREFIX):
        if rejections.record_key(key) not in done:
            examined = stored_quarantine.read(store, key)
            if isinstance(examined, Rejection):
                found.append(examined)
            else:
                valid.add(rejections.record_key(key))
    return found


def supersede(store: StateStore, item: Pending, newest: int) -> None:
    """Record an older version that never ran as superseded by ``newest``."""
    if stored_policies.record_dispatch(store, item.name, item.version, {"superseded_by": newest}):
        reason = f"version {newest} of policy {item.name} was stored before this one ran"
        stored_policies.record_outcome(
            store,
            item.name,
            item.version,
            {"status": "superseded", "state": "Superseded", "reasons": [reason]},
            None,
        )


class Dispatcher:
    """Creates the runs (see the module docstring); ``prefect_api`` is a sync Prefect client,
    ``hold(version, why, flow_run_id)`` makes the policy's alias meet ``version`` and says what
    it did (:func:`dpmerge.policy_merge.promotion.hold`), ``notify(item, flow_run_id)``
    announces a dispatch (default: the Prefect event)."""

    def __init__(
        self,
        store: StateStore,
        prefect_api: Any,
        hold: Callable[[PolicyVersion, str, str], str],
        notify: Callable[[Pending, str], None] | None = None,
        notify_rejected: Callable[[Rejection], None] | None = None,
    ) -> None:
        self.store = store
        self.api = prefect_api
        self.hold = hold
        self.notify = notify or _notify
        self.notify_rejected = notify_rejected or _notify_rejected
        self.deployment_id: Any = None
        self.rescued_at = -RESCUE_EVERY_S
        self.settled: set[tuple[str, int]] = set()  # newest versions whose run has an outcome
        self.valid_quarantine: set[str] = set()  # record keys of quarantine objects read valid

    def _deployment(self) -> Any:
        if self.deployment_id is None:
            self.deployment_id = self.api.read_deployment_by_name(DEPLOYMENT).id
        return self.deployment_id

    def once(self) -> list[str]:
        """One poll: record the operators' requests, dispatch what is pending, then record
        what is refused (see the module docstring); the flow run ids created."""
        for key in inbox.pending(self.store):
            handled = inbox.handle(self.store, key)
            if handled.rejection is not None:
                self._rejected(handled.rejection)
        valid: list[tuple[Pending, PolicyVersion]] = []
        refused: list[tuple[Pending, PolicyError]] = []
        for item in pending(self.store):
            try:
                version = stored_policies.read_version(self.store, item.name, item.version)
            except PolicyError as error:
                refused.append((item, error))
                continue
            if version is not None:  # else removed since the listing
                valid.append((item, version))
        newest: dict[str, int] = {}
        for item, _ in valid:
            newest[item.name] = max(newest.get(item.name, 0), item.version)
        created = []
        for item, version in valid:
            if item.version < newest[item.name]:
                supersede(self.store, item, newest[item.name])
                continue
            created.append(self.dispatch(item, version))
        for item, error in refused:
            self._rejected(reject(self.store, item, error))
        for stray in strays(self.store, self.valid_quarantine):
            if rejections.record(self.store, stray):
                self._rejected(stray)
        if time.monotonic() - self.rescued_at >= RESCUE_EVERY_S:
            self.rescued_at = time.monotonic()
            self.rescue()
        return created

    def _rejected(self, rejection: Rejection) -> None:
        log.warning("rejected %s", rejection.line())
        self.notify_rejected(rejection)

    def rescue(self) -> list[Pending]:
        """Keep the serving invariant for each policy whose newest version's run ended without
        an outcome, record that outcome, and store the version again when the run failed or
        crashed (see the module docstring); the versions stored."""
        from prefect.exceptions import ObjectNotFound

        stored = []
        for name, number in stored_policies.newest_numbers(self.store).items():
            if (name, number) in self.settled:
                continue
            record = stored_policies.dispatched(self.store, name, number) or {}
            if "flow_run" not in record:  # not dispatched yet
                continue
            if stored_policies.outcomes(self.store, name, number):
                self.settled.add((name, number))
                continue
            try:
                run = self.api.read_flow_run(uuid.UUID(record["flow_run"]))
            except ObjectNotFound:  # deleted from Prefect: nothing to read
                continue
            ended = ENDED.get(run.state.type.value) if run.state is not None else None
            if ended is None:  # still going
                continue
            if stored_policies.outcomes(self.store, name, number):  # recorded, then it ended
                self.settled.add((name, number))
                continue
            lost = f"its run {run.id} ended {ended} without an outcome"
            try:
                action = self._hold(name, number, lost, str(run.id))
            except LeaseTimeoutError:  # the lost run's lease has not expired yet
                continue
            again = ended != CANCELLED and self._rescues(name, number) < MAX_RESCUES
            reason = f"{lost}; {action}; " + (
                "applied again"
                if again
                else "not applied again (cancelled)"
                if ended == CANCELLED
                else f"not applied again ({MAX_RESCUES} in a row)"
            )
            stored_policies.record_outcome(
                self.store,
                name,
                number,
                {"status": "failed", "state": ended, "policy_version": number, "reasons": [reason]},
                str(run.id),
            )
            self.settled.add((name, number))
            if not again:
                log.warning("policy %s v%d: %s", name, number, reason)
                continue
            change = stored_policies.set_policy(
                self.store, name, {}, source=f"{RESCUE_SOURCE} (v{number})", rerun=True
            )
            log.info("policy %s v%d: %s as v%d", name, number, reason, change.version.version)
            stored.append(Pending(name, change.version.version))
        return stored

    def _hold(self, name: str, number: int, lost: str, run: str) -> str:
        """Make the policy's alias meet version ``number`` under its lease (taken without
        waiting: :class:`LeaseTimeoutError` while the lost run's lease lives); what was
        done."""
        version = stored_policies.read_version(self.store, name, number)
        assert version is not None  # dispatched, hence stored and valid
        with lease(self.store, name, timeout_s=0):
            try:
                return self.hold(version, lost, run)
            except SupersededError as later:
                return f"version {later.later} of policy {name} already changed its alias"

    def _rescues(self, name: str, number: int) -> int:
        """How many versions in a row, ending at ``number``, the dispatcher itself stored."""
        count = 0
        while number > 0:
            try:
                version = stored_policies.read_version(self.store, name, number)
            except PolicyError:  # written by hand, not valid: not the dispatcher's
                break
            if version is None or not version.source.startswith(RESCUE_SOURCE):
                break
            count, number = count + 1, number - 1
        return count

    def dispatch(self, item: Pending, version: PolicyVersion) -> str:
        from flows.merge import run_name

        name = run_name(version)
        run = self.api.create_flow_run_from_deployment(
            self._deployment(),
            parameters={"policy": item.name, "version": item.version},
            name=name,
            idempotency_key=f"policy-{item.name}-v{item.version}",
        )
        stored_policies.record_dispatch(
            self.store,
            item.name,
            item.version,
            {"flow_run": str(run.id), "flow_run_name": name, "deployment": DEPLOYMENT},
        )
        self.notify(item, str(run.id))
        log.info("policy %s v%d: flow run %s (%s)", item.name, item.version, run.id, name)
        return str(run.id)


def _notify(item: Pending, run: str) -> None:
    from prefect.events import emit_event

    emit_event(
        event=EVENT,
        resource={
            "prefect.resource.id": f"dpmerge.policy.{item.name}",
            "prefect.resource.name": item.name,
        },
        payload={"policy": item.name, "version": item.version, "flow_run": run},
    )


def _notify_rejected(rejection: Rejection) -> None:
    from prefect.events import emit_event

    emit_event(
        event=REJECTED_EVENT,
        resource={"prefect.resource.id": f"dpmerge.state.{rejections.record_key(rejection.key)}"},
        payload=rejection.to_dict(),
    )


def main(argv: list[str] | None = None) -> int:
    """Poll forever (the stack's ``dispatcher`` service); errors are logged and retried.
    ``--heartbeat FILE``: touch FILE after every poll that reached the store and Prefect (the
    stack's health check of the service)."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectException

    from dpmerge.policy_merge import Workspace
    from dpmerge.policy_merge.promotion import hold

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="python -m flows.dispatch", description=__doc__)
    parser.add_argument("--heartbeat", type=Path, default=None, help="file touched per poll")
    heartbeat = parser.parse_args(argv).heartbeat
    workspace = Workspace.from_env()
    store = workspace.state()
    log.info("dispatching policy versions from %s", store.where)
    with get_client(sync_client=True) as prefect_api:
        dispatcher = Dispatcher(
            store, prefect_api, lambda version, why, run: hold(workspace, version, (why,), run)
        )
        while True:
            try:
                dispatcher.once()
                if heartbeat is not None and prefect_api.api_healthcheck() is None:
                    heartbeat.touch()
            except (DPMergeError, OSError, PrefectException, httpx.HTTPError) as error:
                # S3 or the Prefect API answered badly (a 503, no deployment yet): the
                # idempotency key makes the next poll's attempt safe
                log.warning("dispatch failed, retrying: %s: %s", type(error).__name__, error)
                dispatcher.deployment_id = None
            time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
