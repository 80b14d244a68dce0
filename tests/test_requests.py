"""Operators' writes are requests, never state, and every stored object is untrusted input
(issue 28, item 1, rows C and D; dpmerge.state.inbox, dpmerge.state.rejections,
flows/dispatch.py): on the embedded home, with a recording stand-in for Prefect, a request under
``inbox/`` becomes the next version or a rejection naming its field, and deleting it undoes
nothing; no object under ``inbox/``, ``policies/`` or ``quarantine/`` — whatever its key or
bytes, a 200,000-deep JSON array included — crashes, stalls or delays the dispatcher or
``policy ls|show|history``; each ends in one recorded rejection naming its key and field, and a
valid version stored among them is dispatched in the same poll."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_dispatch import BASE, FakePrefect

from dpmerge.keys import WorkflowKey
from dpmerge.policies import PolicyError
from dpmerge.state import LocalBackend, StateStore, inbox, rejections
from dpmerge.state import policies as stored_policies
from dpmerge.state import quarantine as stored_quarantine
from dpmerge.state.store import MAX_DEPTH, MAX_OPERATOR_BYTES
from flows.commands import policy_views
from flows.dispatch import Dispatcher
from flows.merge import run_name  # Prefect imported here, not under a test's capsys

POLL_BOUND_S = 30.0
"""One poll over every request of a test must end within this (generous under CI load: one poll
over 200 small local objects takes well under a second)."""


def _store(root: Path) -> StateStore:
    return StateStore(LocalBackend(root / "state"), WorkflowKey.generate())


def _valid(store: StateStore, name: str, epsilon: float) -> int:
    fields = {**BASE, "target_epsilon": epsilon}
    return stored_policies.set_policy(store, name, fields, source="test").version.version


def _plant(store: StateStore, key: str, data: bytes) -> None:
    """What one operator PUT does: any key, any bytes (the local backend's own write path)."""
    store.backend.create(key, data)


def _document(policy_name: str = "eu", version: int = 1, **changed: Any) -> bytes:
    """A valid stored version of policy ``policy_name`` with ``changed`` top-level fields
    (``None``: removed)."""
    policy = {**BASE, "name": policy_name, "target_epsilon": 1.0}
    document = stored_policies.PolicyVersion(
        stored_policies.merged(None, policy), version, "2026-01-01T00:00:00+00:00", "t", "test"
    ).to_dict()
    for field, value in changed.items():
        if value is None:
            document.pop(field)
        else:
            document[field] = value
    return json.dumps(document).encode()


class Recorder:
    def __init__(self) -> None:
        self.dispatched: list[tuple[str, int]] = []
        self.rejected: list[rejections.Rejection] = []


def _dispatcher(store: StateStore) -> tuple[Dispatcher, FakePrefect, Recorder]:
    api, seen = FakePrefect(), Recorder()
    dispatcher = Dispatcher(
        store,
        api,
        lambda version, why, run: "alias untouched",
        notify=lambda item, run: seen.dispatched.append((item.name, item.version)),
        notify_rejected=seen.rejected.append,
    )
    return dispatcher, api, seen


def _poll(dispatcher: Dispatcher) -> list[str]:
    started = time.monotonic()
    created = dispatcher.once()
    assert time.monotonic() - started < POLL_BOUND_S
    return created


def _views(store: StateStore, capsys: pytest.CaptureFixture[str]) -> str:
    """``policy ls``, and ``show``/``history`` of every policy with a key of the right shape:
    each answers (exit 0, or one PolicyError line), never a traceback."""
    where = {"registry": {"uri": "test", "kind": "embedded", "source": "test"}, "state": "test"}
    assert policy_views.show("ls", argparse.Namespace(json=False), store, where) == 0
    assert policy_views.show("ls", argparse.Namespace(json=True), store, where) == 0
    for name in stored_policies.policy_names(store):
        for command in ("show", "history"):
            args = argparse.Namespace(name=name, json=False)
            try:
                assert policy_views.show(command, args, store, where) == 0
            except PolicyError as error:  # a policy with no valid version: one line
                assert "\n" not in str(error) and command == "show"
    return capsys.readouterr().out


# --- row C: keys of another shape -----------------------------------------------------------

BAD_KEYS = [
    "policies/%2E%2E/x/y.json",
    "policies/eu/latest.json",
    "policies/eu/1.json",
    "policies/eu/000000001.json",  # version 1 spelt with 9 digits
    "policies/eu/00000000.json",  # version 0
    "policies/EU/00000001.json",  # no policy can be named EU
    "policies/eu/00000001.json.bak",
    "policies/eu/sub/00000001.json",
    "policies/x.json",
    "quarantine/m/evil.json",
    "quarantine/m/00000001.json/x",
    "quarantine/m/-1.json",
]


def test_keys_of_another_shape_are_rejected_once_and_never_stop_dispatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(tmp_path)
    for key in BAD_KEYS:
        _plant(store, key, b'{"anything": 1}')
    _valid(store, "zz-last", 1.0)  # sorts after every bad key
    dispatcher, api, seen = _dispatcher(store)
    (run,) = _poll(dispatcher)
    assert seen.dispatched == [("zz-last", 1)]
    assert stored_policies.dispatched(store, "zz-last", 1)["flow_run"] == run
    assert api.calls[0]["name"] == run_name(stored_policies.read_version(store, "zz-last", 1))
    assert sorted(r.key for r in seen.rejected) == sorted(BAD_KEYS)
    assert {r.field for r in seen.rejected} == {"key"}
    recorded = rejections.recorded(store)
    assert sorted(r["key"] for r in recorded) == sorted(BAD_KEYS)
    # recorded once: the next poll reads none of them again, rejects nothing, creates nothing
    assert _poll(dispatcher) == [] and len(seen.rejected) == len(BAD_KEYS)
    assert len(api.calls) == 1
    # a later valid version of a policy is still dispatched; set_policy ignores the bad keys
    assert _valid(store, "eu", 2.0) == 1
    _poll(dispatcher)
    assert seen.dispatched[-1] == ("eu", 1)
    out = _views(store, capsys)
    assert out.count("rejected (never applied): ") == len(BAD_KEYS)


# --- row D: bodies that are not a valid version ----------------------------------------------


def _bodies() -> dict[str, tuple[bytes, str]]:
    """Policy name → a body stored as its version 1, and the field its rejection must name."""
    deep = 200_000
    policy = {**BASE, "target_epsilon": 1.0}
    cases: dict[str, tuple[Callable[[str], bytes], str]] = {
        "not-json": (lambda n: b"{not json", "body"),
        "not-utf8": (lambda n: b"\xff\xfe{}", "body"),
        "a-list": (lambda n: b"[1, 2]", "body"),
        "deep-array": (lambda n: b"[" * deep + b"]" * deep, "body"),  # over the size cap too
        "deep-in-cap": (lambda n: b'{"a":' + b"[" * 20_000 + b"]" * 20_000 + b"}", "body"),
        "deep-object": (
            lambda n: b'{"a":' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1),
            "body",
        ),
        "huge": (lambda n: b'{"a": "' + b"x" * MAX_OPERATOR_BYTES + b'"}', "body"),
        "nan": (
            lambda n: _document(n).replace(b'"target_epsilon": 1.0', b'"target_epsilon": NaN'),
            "body",
        ),
        "twice": (lambda n: _document(n)[:-1] + b', "version": 1}', "body"),
        "unknown": (lambda n: _document(n, extra=1), "extra"),
        "missing": (lambda n: _document(n, author=None), "author"),
        "v0": (lambda n: _document(n, version=0), "version"),
        "v-bool": (lambda n: _document(n, version=True), "version"),
        "v-other": (lambda n: _document(n, version=7), "version"),
        "other-name": (lambda n: _document(n, name="us"), "name"),
        "schema": (lambda n: _document(n, schema="dpmerge.policy-version/0"), "schema"),
        "author-int": (lambda n: _document(n, author=5), "author"),
        "changes": (lambda n: _document(n, changes={"a": 1}), "changes"),
        "policy-list": (lambda n: _document(n, policy=[]), "policy"),
        "epsilon-str": (
            lambda n: _document(n, policy={**policy, "name": n, "target_epsilon": "1"}),
            "policy.target_epsilon",
        ),
        "delta-1": (
            lambda n: _document(n, policy={**policy, "name": n, "target_delta": 1.0}),
            "policy.target_delta",
        ),
        "policy-extra": (
            lambda n: _document(n, policy={**policy, "name": n, "x": 1}),
            "policy.x",
        ),
        "other-policy": (lambda n: _document(n, policy={**policy, "name": "us"}), "name"),
    }
    return {name: (make(name), field) for name, (make, field) in cases.items()}


def test_invalid_versions_are_rejected_naming_the_field_and_never_stop_dispatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(tmp_path)
    bodies = _bodies()
    for name, (data, _) in bodies.items():
        _plant(store, stored_policies.version_key(name, 1), data)
    _valid(store, "zz-last", 1.0)
    dispatcher, api, seen = _dispatcher(store)
    _poll(dispatcher)
    assert seen.dispatched == [("zz-last", 1)] and len(api.calls) == 1
    for name, (_, field) in bodies.items():
        (outcome,) = stored_policies.outcomes(store, name, 1)
        assert (outcome["status"], outcome["state"]) == ("rejected", "Rejected"), name
        assert outcome["rejected"]["field"] == field, (name, outcome["rejected"])
        assert outcome["rejected"]["key"] == stored_policies.version_key(name, 1)
        assert "flow_run" not in stored_policies.dispatched(store, name, 1)
    assert len(seen.rejected) == len(bodies)
    assert _poll(dispatcher) == [] and len(seen.rejected) == len(bodies)  # handled once
    # an invalid newest version supersedes nothing; a valid one after it is dispatched
    assert _valid(store, "nan", 2.0) == 2
    _poll(dispatcher)
    assert seen.dispatched[-1] == ("nan", 2)
    out = _views(store, capsys)
    assert "v1  rejected (field 'body'" in out and "Traceback" not in out


def test_an_invalid_version_never_supersedes_a_valid_one(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _valid(store, "eu", 1.0)
    _plant(store, stored_policies.version_key("eu", 2), b"[" * 50 + b"]" * 50)
    dispatcher, _, seen = _dispatcher(store)
    _poll(dispatcher)
    assert seen.dispatched == [("eu", 1)]
    assert stored_policies.outcomes(store, "eu", 2)[0]["rejected"]["field"] == "body"
    assert stored_policies.latest(store, "eu").version == 1
    assert _valid(store, "eu", 3.0) == 3  # numbered after the invalid one


def test_bad_quarantine_records_are_rejected_and_left_out(tmp_path: Path) -> None:
    store = _store(tmp_path)
    model = "dpmerge-digits-logreg-candidates"
    stored_quarantine.quarantine(store, model, "2", "a bad record")
    _plant(store, f"quarantine/{model}/evil.json", b"{}")
    _plant(store, f"quarantine/{model}/00000003.json", b"[" * 40_000 + b"]" * 40_000)
    _plant(store, f"quarantine/{model}/00000004.json", json.dumps({"model": model}).encode())
    good = stored_quarantine.quarantined(store, model)
    assert list(good) == ["2"] and good["2"].reason == "a bad record"
    dispatcher, _, seen = _dispatcher(store)
    _poll(dispatcher)
    fields = {r.key.rsplit("/", 1)[1]: r.field for r in seen.rejected}
    assert fields == {"evil.json": "key", "00000003.json": "body", "00000004.json": "version"}
    _poll(dispatcher)
    assert len(seen.rejected) == 3


# --- the inbox: operators write requests, the workflow records them ---------------------------


def _request(policy_name: str, **changed: Any) -> dict[str, Any]:
    """A valid request to create policy ``policy_name``, with ``changed`` fields."""
    return {
        "schema": inbox.SCHEMA,
        "name": policy_name,
        "fields": {**BASE, "name": policy_name, "target_epsilon": 1.0},
        "rerun": False,
        "author": "operator@host",
        "source": "test",
        "created": "2026-01-01T00:00:00+00:00",
        **changed,
    }


REQUEST_ID = "20260101T000000Z-0123456789abcdef"


def test_a_request_becomes_the_next_version_and_deleting_it_undoes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(tmp_path)
    key = inbox.submit_policy(store, "eu", _request("eu")["fields"], source="test", rerun=False)
    assert stored_policies.newest_number(store, "eu") == 0  # a request is not state
    dispatcher, api, seen = _dispatcher(store)
    (run,) = _poll(dispatcher)
    assert stored_policies.dispatched(store, "eu", 1)["flow_run"] == run
    handled = inbox.handled(store, key)
    assert (handled["status"], handled["version"]) == ("applied", 1)
    assert seen.dispatched == [("eu", 1)] and api.calls[0]["parameters"]["version"] == 1
    version = stored_policies.read_version(store, "eu", 1)
    assert version.author == stored_policies.actor() and key.rsplit("/", 1)[1][:-5] in (
        version.source
    )
    (store.backend.root / key).unlink()  # the operator deletes the request: nothing changes
    assert _poll(dispatcher) == [] and stored_policies.read_version(store, "eu", 1) == version
    # the same fields again change nothing; a bad request is rejected naming the field
    again = inbox.submit_policy(store, "eu", _request("eu")["fields"], source="test", rerun=False)
    bad_fields = {**_request("eu")["fields"], "target_delta": 1.0}
    bad = inbox.submit_policy(store, "eu", bad_fields, source="test", rerun=False)
    _poll(dispatcher)
    assert inbox.handled(store, again)["status"] == "unchanged"
    rejected = inbox.handled(store, bad)
    assert rejected["status"] == "rejected"
    assert rejected["rejected"]["field"] == "fields.target_delta"
    assert stored_policies.newest_number(store, "eu") == 1 and len(seen.rejected) == 1
    out = _views(store, capsys)
    assert f"rejected (never applied): {bad}: field 'fields.target_delta'" in out


def test_a_quarantine_request_is_recorded_and_deleting_it_undoes_nothing(tmp_path: Path) -> None:
    store = _store(tmp_path)
    model = "dpmerge-digits-logreg-candidates"
    key = inbox.submit_quarantine(store, model, "3", "forged record")
    assert stored_quarantine.quarantined(store, model) == {}  # a request is not state
    dispatcher, _, seen = _dispatcher(store)
    _poll(dispatcher)
    assert inbox.handled(store, key)["status"] == "applied"
    (store.backend.root / key).unlink()
    assert stored_quarantine.quarantined(store, model)["3"].reason == "forged record"
    _plant(store, f"inbox/quarantine/{model}/00000004.json", b'{"model": 1}')
    _poll(dispatcher)
    assert [r.field for r in seen.rejected] == ["model"]
    assert list(stored_quarantine.quarantined(store, model)) == ["3"]


# --- the fuzz: ≥ 200 malformed requests through the inbox -----------------------------------

_NAMES = st.one_of(
    st.from_regex(r"[a-z0-9][a-z0-9_-]{0,10}", fullmatch=True),
    st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=12).filter(
        lambda t: "/" not in t and not t.startswith(".") and t.isprintable()
    ),
)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def _requests(draw: st.DrawFn) -> tuple[str, bytes]:
    """A malformed request: a key of another shape under inbox/, or a request key holding no
    valid request."""
    kind = draw(st.sampled_from(["key", "bytes", "json", "field", "deep"]))
    name = draw(st.from_regex(r"f[a-z0-9]{0,10}", fullmatch=True))
    request = draw(st.from_regex(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{16}", fullmatch=True))
    key = f"{inbox.POLICIES}{name}/{request}.json"
    if kind == "key":
        prefix = draw(st.sampled_from([inbox.POLICIES, inbox.QUARANTINE, inbox.PREFIX]))
        key = f"{prefix}{draw(_NAMES)}/{draw(_NAMES)}.k"  # never a folder of another key
        return key, draw(st.binary(max_size=64))
    if kind == "bytes":
        return key, draw(st.binary(max_size=256))
    if kind == "json":
        return key, json.dumps(draw(_JSON)).encode()
    if kind == "deep":
        depth = draw(st.integers(MAX_DEPTH + 1, 30_000))
        return key, b"[" * depth + b"]" * depth
    document = _request(name)
    field = draw(st.sampled_from(sorted(document)))
    document[field] = draw(_JSON.filter(lambda v: _breaks(field, v, document[field])))
    return key, json.dumps(document).encode()


def _breaks(field: str, value: Any, valid: Any) -> bool:
    """Whether ``value`` in ``field`` makes a stored version invalid (another string is a
    valid author, either boolean a valid ``rerun``; an empty change map is valid)."""
    if field in ("created", "author", "source"):
        return not isinstance(value, str)
    if field == "rerun":
        return not isinstance(value, bool)
    if field == "fields":  # no valid new policy (it lacks its target, or is no object)
        return not (isinstance(value, dict) and "target_epsilon" in value)
    return value != valid or type(value) is not type(valid)


def test_fuzz_every_malformed_request_is_one_rejection(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """At least 200 malformed requests through the inbox, in batches, with a valid request
    among each batch: each malformed one ends in exactly one recorded rejection naming a field,
    nothing of it reaches the canonical tree, no poll raises or exceeds its bound, and the
    valid request is recorded and dispatched in the poll that first sees it."""
    seen_total = {"requests": 0}

    @settings(
        max_examples=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.lists(_requests(), min_size=8, max_size=12, unique_by=lambda r: r[0]))
    def run(batch: list[tuple[str, bytes]]) -> None:
        store = _store(tmp_path_factory.mktemp("fuzz"))
        for key, data in batch:
            _plant(store, key, data)
        fields = {**BASE, "target_epsilon": 1.0}
        valid = inbox.submit_policy(store, "zz-valid", fields, source="fuzz", rerun=False)
        dispatcher, api, seen = _dispatcher(store)
        _poll(dispatcher)
        assert seen.dispatched == [("zz-valid", 1)]
        assert inbox.handled(store, valid)["status"] == "applied"
        for key, _ in batch:
            handled = inbox.handled(store, key)
            assert handled["status"] == "rejected" and handled["rejected"]["field"], key
        assert len(seen.rejected) == len(batch)
        assert stored_policies.policy_names(store) == ["zz-valid"]
        assert store.keys("quarantine/") == []
        _poll(dispatcher)
        assert len(seen.rejected) == len(batch) and len(api.calls) == 1
        seen_total["requests"] += len(batch)

    run()
    assert seen_total["requests"] >= 200
