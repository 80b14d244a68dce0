"""``policy set --wait``'s poller waits out a transient outage of the state store (S3 or MLflow
restarting) instead of giving up at once (issue 28, "other things"); only an outage that lasts
to the deadline, or an error that is not transient, ends the wait (README, "Policies")."""

from __future__ import annotations

from typing import Any

import pytest

from dpmerge.errors import RefusalError
from dpmerge.policies import policy_from_dict
from dpmerge.state import policies as stored_policies
from dpmerge.state.policies import PolicyVersion
from dpmerge.storage import StorageUnavailableError
from flows.commands import policy as policy_command

VERSION = PolicyVersion(
    policy_from_dict(
        {"name": "eu", "target_epsilon": 2.0, "target_delta": 1e-5, "dataset": "digits"}
        | {"model": "logreg"}
    ),
    3,
    "2026-01-01T00:00:00Z",
    "operator",
    "test",
)
OUTCOME = {"policy": "eu", "policy_version": 3, "status": "promoted"}
RUN = {"flow_run": "r-1", "flow_run_name": "policy-eu-v3"}


class Flaky:
    """A store read that fails with ``error`` ``failures`` times, then finds ``found``."""

    def __init__(self, failures: int, found: Any, error: BaseException) -> None:
        self.failures, self.found, self.error, self.calls = failures, found, error, 0

    def __call__(self, store: Any, name: str, version: int) -> Any:
        assert (name, version) == ("eu", 3)
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return self.found


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy_command, "POLL_S", 0.01)


def _outage() -> StorageUnavailableError:
    return StorageUnavailableError("S3 at http://127.0.0.1:1 is unreachable (connection refused)")


def test_the_outcome_wait_outlasts_a_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = Flaky(5, [{"status": "failed"}, OUTCOME], _outage())
    monkeypatch.setattr(stored_policies, "outcomes", reads)
    assert policy_command.wait_for_outcome(object(), VERSION, 60) == OUTCOME
    assert reads.calls == 6


def test_the_dispatch_wait_outlasts_a_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = Flaky(5, RUN, ConnectionRefusedError("connection refused"))
    monkeypatch.setattr(stored_policies, "dispatched", reads)
    assert policy_command.wait_for_dispatch(object(), VERSION, 60) == RUN
    assert reads.calls == 6


def test_an_outage_lasting_to_the_deadline_is_the_news(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = Flaky(10**9, [OUTCOME], _outage())
    monkeypatch.setattr(stored_policies, "outcomes", reads)
    with pytest.raises(StorageUnavailableError, match="unreachable"):
        policy_command.wait_for_outcome(object(), VERSION, 0.2)
    assert reads.calls > 1  # retried until the deadline, not given up at once


def test_no_outcome_by_the_deadline_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = Flaky(2, [], _outage())
    monkeypatch.setattr(stored_policies, "outcomes", reads)
    assert policy_command.wait_for_outcome(object(), VERSION, 0.2) is None
    assert reads.calls > 3


def test_a_refusal_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = Flaky(1, [OUTCOME], RefusalError("access denied"))
    monkeypatch.setattr(stored_policies, "outcomes", reads)
    with pytest.raises(RefusalError):
        policy_command.wait_for_outcome(object(), VERSION, 60)
    assert reads.calls == 1
