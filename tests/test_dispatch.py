"""The policy dispatcher (flows/dispatch.py, docs/workflow.md#policy-dispatch) against a
recording stand-in for the Prefect API: one run per newest stored version, an idempotency key
per version, older undispatched versions recorded superseded, nothing dispatched twice, and a
refused creation retried at the next poll."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prefect.client.schemas.objects import StateType

from dpmerge.keys import WorkflowKey
from dpmerge.state import LocalBackend, StateStore
from dpmerge.state import policies as stored_policies
from dpmerge.state.leases import lease
from dpmerge.vocabulary import ExitCode
from flows.commands import policy as policy_command
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


ENDINGS = (StateType.CRASHED, StateType.FAILED)


class Held:
    """Records each call of the dispatcher's ``hold`` (the serving invariant kept for a version
    whose run ended without an outcome) and says what it did."""

    action = "alias 'policy-eu' revoked (was v1: its ε exceeds ε*)"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, str, str]] = []

    def __call__(self, version: Any, why: str, run: str) -> str:
        self.calls.append((version, why, run))
        return self.action


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    return StateStore(LocalBackend(tmp_path / "state"), WorkflowKey.generate())


def _set(store: StateStore, name: str, epsilon: float) -> int:
    fields = {**BASE, "target_epsilon": epsilon}
    return stored_policies.set_policy(store, name, fields, source="test").version.version


def test_the_newest_version_of_each_policy_becomes_one_run(store: StateStore) -> None:
    api, notes = FakePrefect(), []
    dispatcher = Dispatcher(store, api, Held(), notify=lambda item, run: notes.append((item, run)))
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
    dispatcher = Dispatcher(store, api, Held(), notify=lambda item, run: None)
    _set(store, "eu", 1.0)
    with pytest.raises(OSError, match="503"):
        dispatcher.once()
    assert stored_policies.dispatched(store, "eu", 1) is None  # not recorded: retried
    (run,) = dispatcher.once()
    assert len(api.calls) == 2 and len(api.runs) == 1  # the same key both times
    assert stored_policies.dispatched(store, "eu", 1)["flow_run"] == run


def test_a_failed_or_crashed_run_is_applied_again_at_most_twice_in_a_row(
    store: StateStore,
) -> None:
    """A run that ended Crashed (its process lost) or Failed without an outcome: the alias is
    made to meet its version first, then the outcome is recorded (saying what was done) and
    the same fields stored again as a new version, which the next poll dispatches; a run that
    is still going, or ended with an outcome, is left alone; after MAX_RESCUES in a row the
    policy is left to a person, with the last one recorded (not re-examined forever)."""
    api, held = FakePrefect(), Held()
    dispatcher = Dispatcher(store, api, held, notify=lambda item, run: None)
    _set(store, "eu", 1.0)
    dispatcher.once()
    assert dispatcher.rescue() == [] and held.calls == []  # still running: nothing to do
    for attempt, ended in zip(range(1, MAX_RESCUES + 1), ENDINGS, strict=False):
        api.states[f"policy-eu-v{attempt}"] = ended
        (again,) = dispatcher.rescue()
        assert again.version == attempt + 1
        assert [(v.name, v.version) for v, _, _ in held.calls[-1:]] == [("eu", attempt)]
        (outcome,) = stored_policies.outcomes(store, "eu", attempt)
        assert (outcome["status"], outcome["state"], outcome["policy_version"]) == (
            "failed",
            ended.value.title(),
            attempt,
        )
        assert f"ended {ended.value.title()} without an outcome" in outcome["reasons"][0]
        assert held.action in outcome["reasons"][0] and "applied again" in outcome["reasons"][0]
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
    assert "not applied again" in last["reasons"][0] and held.action in last["reasons"][0]
    assert dispatcher.rescue() == []  # recorded: not looked at again
    # an operator's change starts a new count; a completed run is never applied again
    _set(store, "eu", 2.0)
    dispatcher.once()
    api.states[f"policy-eu-v{MAX_RESCUES + 2}"] = StateType.COMPLETED
    calls = len(held.calls)
    assert dispatcher.rescue() == [] and len(held.calls) == calls


def test_a_cancelled_run_keeps_the_invariant_and_is_not_applied_again(
    store: StateStore,
) -> None:
    """Cancelled by hand without an outcome: the alias is made to meet the version and the
    outcome recorded, nothing stored again. While the run's lease lives (a lost process's
    expires within its TTL) nothing is done; the next round does it."""
    api, held = FakePrefect(), Held()
    dispatcher = Dispatcher(store, api, held, notify=lambda item, run: None)
    _set(store, "eu", 1.0)
    dispatcher.once()
    api.states["policy-eu-v1"] = StateType.CANCELLED
    taken, done = threading.Event(), threading.Event()

    def the_lost_runs_lease() -> None:  # another holder, as the run's process is
        with lease(store, "eu", 1.0):
            taken.set()
            done.wait(30)

    holder = threading.Thread(target=the_lost_runs_lease)
    holder.start()
    assert taken.wait(30)
    assert dispatcher.rescue() == []
    done.set()
    holder.join()
    assert held.calls == [] and stored_policies.outcomes(store, "eu", 1) == []
    assert dispatcher.rescue() == []
    assert [(v.name, v.version) for v, _, _ in held.calls] == [("eu", 1)]
    (outcome,) = stored_policies.outcomes(store, "eu", 1)
    assert (outcome["status"], outcome["state"]) == ("failed", "Cancelled")
    assert "not applied again (cancelled)" in outcome["reasons"][0]
    assert stored_policies.newest_number(store, "eu") == 1


@pytest.mark.parametrize("ended", [StateType.FAILED, StateType.CRASHED, StateType.CANCELLED])
def test_policy_set_wait_returns_when_the_run_ends_in_any_state(
    store: StateStore, ended: StateType, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 28 item 2: `policy set --wait` on a run that ended without an outcome reads the
    outcome the dispatcher records (within one rescue period), exits 1 and prints one line
    — it does not wait out its timeout."""
    api = FakePrefect()
    dispatcher = Dispatcher(store, api, Held(), notify=lambda item, run: None)
    number = _set(store, "eu", 1.0)
    dispatcher.once()
    version = stored_policies.read_version(store, "eu", number)
    api.states[f"policy-eu-v{number}"] = ended
    assert policy_command.wait_for_outcome(store, version, 0.05) is None  # not yet rescued
    dispatcher.rescued_at = -1e9
    dispatcher.once()
    started = time.monotonic()
    outcome = policy_command.wait_for_outcome(store, version, 60)
    assert outcome is not None and time.monotonic() - started < 5
    assert policy_command._exit_code(outcome["status"]) == ExitCode.FAILURE
    line = policy_command.outcome_line(outcome)
    assert "\n" not in line and f"ended {ended.value.title()} without an outcome" in line


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
