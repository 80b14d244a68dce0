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

from dpmerge.keys import WorkflowKey
from dpmerge.state import LocalBackend, StateStore
from dpmerge.state import policies as stored_policies
from flows.dispatch import DEPLOYMENT, Dispatcher

BASE = {"target_delta": 1e-5, "dataset": "digits", "model": "logreg"}


@dataclass
class FakePrefect:
    """Records create_flow_run_from_deployment; a run per idempotency key, as Prefect does."""

    runs: dict[str, Any] = field(default_factory=dict)
    calls: list[dict[str, Any]] = field(default_factory=list)
    refuse: int = 0

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
