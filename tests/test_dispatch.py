"""The policy dispatcher (flows/dispatch.py, docs/workflow.md#policy-dispatch) against a
recording stand-in for the Prefect API: one run per newest stored version, an idempotency key
per version, older undispatched versions recorded superseded, nothing dispatched twice, and a
refused creation retried at the next poll."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prefect.client.schemas.objects import StateType

from dpmerge.keys import WorkflowKey
from dpmerge.state import LocalBackend, StateStore
from dpmerge.state import policies as stored_policies
from flows.dispatch import DEPLOYMENT, MAX_RESCUES, RESCUE_SOURCE, Dispatcher

BASE = {"target_delta": 1e-5, "dataset": "digits", "model": "logreg"}


@dataclass
class FakePrefect:
    """Records create_flow_run_from_deployment; a run per idempotency key, as Prefect does."""

    runs: dict[str, Any] = field(default_factory=dict)
    calls: list[dict[str, Any]] = field(default_factory=list)
    refuse: int = 0
    states: dict[str, StateType] = field(default_factory=dict)  # by idempotency key; RUNNING

    def read_flow_run(self, flow_run_id: uuid.UUID) -> Any:
        key = next(k for k, run in self.runs.items() if run.id == flow_run_id)
        state = type("State", (), {"type": self.states.get(key, StateType.RUNNING)})()
        return type("FlowRun", (), {"id": flow_run_id, "state": state})()

    def read_deployment_by_name(self, name: str) -> Any:
        assert name == DEPLOYMENT
        return type("Deployment", (), {"id": "deployment-1"})()

    def create_flow_run_from_deployment(self, deployment_id: Any, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        if self.refuse:
            self.refuse -= 1
            raise OSError("503 Service Unavailable")
        key = kwargs["idempotency_key"]
        if key not in self.runs:
            self.runs[key] = type("Run", (), {"id": uuid.uuid4()})()
        return self.runs[key]


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    return StateStore(LocalBackend(tmp_path / "state"), WorkflowKey.generate())


def _set(store: StateStore, name: str, epsilon: float) -> int:
    fields = {**BASE, "target_epsilon": epsilon}
    return stored_policies.set_policy(store, name, fields, source="test").version.version


def test_the_newest_version_of_each_policy_becomes_one_run(store: StateStore) -> None:
    api, notes = FakePrefect(), []
    dispatcher = Dispatcher(store, api, notify=lambda item, run: notes.append((item, run)))
    for epsilon in (1.0, 2.0, 3.0):
        _set(store, "eu", epsilon)
    _set(store, "us", 4.0)
    created = dispatcher.once()
    assert len(created) == 2 and len(notes) == 2
    keys = sorted(call["idempotency_key"] for call in api.calls)
    assert keys == ["policy-eu-v3", "policy-us-v1"]
    by_key = {call["idempotency_key"]: call for call in api.calls}
    assert by_key["policy-eu-v3"]["parameters"] == {"policy": "eu", "version": 3}
    assert by_key["policy-eu-v3"]["name"] == "policy-eu v3 ε*=3"
    # the older versions never ran: recorded as superseded, with an outcome
    for old in (1, 2):
        assert stored_policies.dispatched(store, "eu", old) == {
            "policy": "eu",
            "version": old,
            "superseded_by": 3,
        }
        (outcome,) = stored_policies.outcomes(store, "eu", old)
        assert outcome["status"] == "superseded"
    recorded = stored_policies.dispatched(store, "eu", 3)
    assert recorded["flow_run"] == str(api.runs["policy-eu-v3"].id)
    assert dispatcher.once() == [] and len(api.calls) == 2  # nothing dispatched twice


def test_a_refused_creation_is_retried_and_makes_one_run(store: StateStore) -> None:
    api = FakePrefect(refuse=1)
    dispatcher = Dispatcher(store, api, notify=lambda item, run: None)
    _set(store, "eu", 1.0)
    with pytest.raises(OSError, match="503"):
        dispatcher.once()
    assert stored_policies.dispatched(store, "eu", 1) is None  # not recorded: retried
    (run,) = dispatcher.once()
    assert len(api.calls) == 2 and len(api.runs) == 1  # the same key both times
    assert stored_policies.dispatched(store, "eu", 1)["flow_run"] == run


def test_a_crashed_run_is_applied_again_at_most_twice_in_a_row(store: StateStore) -> None:
    """A run whose process was lost (Crashed, no outcome) gets its outcome recorded and the
    same fields stored again as a new version, which the next poll dispatches; a run that is
    still going, or ended with an outcome, is left alone; after MAX_RESCUES crashes in a row
    the policy is left to a person, with the last crash recorded (not re-examined forever)."""
    api = FakePrefect()
    dispatcher = Dispatcher(store, api, notify=lambda item, run: None)
    _set(store, "eu", 1.0)
    dispatcher.once()
    assert dispatcher.rescue() == []  # still running: nothing to do
    for attempt in range(1, MAX_RESCUES + 1):
        api.states[f"policy-eu-v{attempt}"] = StateType.CRASHED
        (again,) = dispatcher.rescue()
        assert again.version == attempt + 1
        (outcome,) = stored_policies.outcomes(store, "eu", attempt)
        assert (outcome["status"], outcome["state"], outcome["policy_version"]) == (
            "failed",
            "Crashed",
            attempt,
        )
        assert "applied again" in outcome["reasons"][0]
        stored = stored_policies.read_version(store, "eu", again.version)
        assert stored.source.startswith(RESCUE_SOURCE) and stored.changes == {}
        assert stored.policy == stored_policies.read_version(store, "eu", 1).policy
        dispatcher.rescued_at = -1e9
        dispatcher.once()  # dispatches the new version
        assert api.calls[-1]["idempotency_key"] == f"policy-eu-v{again.version}"
    api.states[f"policy-eu-v{MAX_RESCUES + 1}"] = StateType.CRASHED
    assert dispatcher.rescue() == []
    assert stored_policies.newest_number(store, "eu") == MAX_RESCUES + 1
    (last,) = stored_policies.outcomes(store, "eu", MAX_RESCUES + 1)
    assert "not applied again" in last["reasons"][0]
    assert dispatcher.rescue() == []  # recorded: not looked at again
    # an operator's change starts a new count; a completed run is never applied again
    _set(store, "eu", 2.0)
    dispatcher.once()
    api.states[f"policy-eu-v{MAX_RESCUES + 2}"] = StateType.COMPLETED
    assert dispatcher.rescue() == []


def test_a_stale_dispatcher_heartbeat_is_unhealthy_with_its_reason(tmp_path: Path) -> None:
    """Health means alive (issue 28, item 7): a heartbeat touched after the process started and
    within the period is healthy; one older than the period, one from before the process
    started, none, or a process that is gone each say why."""
    import os

    from devstack.processes import started_at
    from devstack.services import DISPATCH_HEARTBEAT_PERIOD_S, heartbeat_problem

    beat, pid = tmp_path / "dispatcher.heartbeat", os.getpid()
    assert "no heartbeat yet" in heartbeat_problem(beat, pid)
    beat.touch()
    assert heartbeat_problem(beat, pid) is None
    later = beat.stat().st_mtime + DISPATCH_HEARTBEAT_PERIOD_S + 5
    assert heartbeat_problem(beat, pid, now=later).startswith(
        f"its last heartbeat is {DISPATCH_HEARTBEAT_PERIOD_S + 5:.0f} s old (more than"
    )
    before = started_at(pid) - 5
    os.utime(beat, (before, before))
    assert "no heartbeat since its process started" in heartbeat_problem(beat, pid)
    gone = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 10_000
    assert heartbeat_problem(beat, gone) == f"process {gone} is gone"
