"""Policies are strict data: a bad policy names its field and changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpmerge.policies import PolicyError, load_policies, policy_from_dict

REPO = Path(__file__).resolve().parents[1]


def base(**overrides):
    data = {
        "name": "eu",
        "target_epsilon": 2.0,
        "target_delta": 1e-5,
        "dataset": "fashion-mnist",
        "model": "logreg",
    }
    data.update(overrides)
    return data


def test_defaults_are_the_safe_ones():
    policy = policy_from_dict(base())
    assert policy.gating_bound == "generic"
    assert policy.on_infeasible == "revoke"
    assert policy.method == "auto"
    assert policy.alias == "policy-eu"
    assert policy.resource_id == "dpmerge.policy.eu"
    assert set(policy.event_payload()) >= {"name", "target_epsilon", "target_delta", "alias"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"target_epsilon": -1}, "target_epsilon"),
        ({"target_epsilon": float("inf")}, "target_epsilon"),
        ({"target_delta": 1.5}, "target_delta"),
        ({"method": "average"}, "method"),
        ({"gating_bound": "heuristic"}, "gating_bound"),
        ({"min_accuracy": 1.2}, "min_accuracy"),
        ({"on_infeasible": "ignore"}, "on_infeasible"),
        ({"name": "EU region!"}, "name"),
        ({"alias": "latest"}, "alias"),
        ({"alias": "v3"}, "alias"),
        ({"colour": "blue"}, "unknown field 'colour'"),
        ({"method": "rs", "gating_bound": "structured"}, "applies to LC"),
    ],
)
def test_bad_policies_name_the_field(overrides, message):
    with pytest.raises(PolicyError, match=message):
        policy_from_dict(base(**overrides))


def test_missing_field_is_named():
    data = base()
    del data["target_delta"]
    with pytest.raises(PolicyError, match="missing field 'target_delta'"):
        policy_from_dict(data)


def test_the_shipped_policy_file_is_valid():
    policies = load_policies(REPO / "deployments" / "policies.yaml")
    assert [p.name for p in policies] == ["eu", "strict-region"]


def test_policy_files_are_checked_whole(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "policies:\n  - {name: a, target_epsilon: 1, target_delta: 1e-5, "
        "dataset: d, model: m}\n  - {name: a, target_epsilon: 2, target_delta: 1e-5,"
        " dataset: d, model: m}\n"
    )
    with pytest.raises(PolicyError, match="unique"):
        load_policies(path)
    path.write_text("policies: [")
    with pytest.raises(PolicyError, match="not valid"):
        load_policies(path)
    with pytest.raises(PolicyError, match="not found"):
        load_policies(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"target_epsilon": True}, "target_epsilon"),
        ({"target_epsilon": "2"}, "target_epsilon"),
        ({"target_delta": False}, "target_delta"),
        ({"min_accuracy": "0.8"}, "min_accuracy"),
        ({"cumulative_epsilon_cap": True}, "cumulative_epsilon_cap"),
        ({"dataset": 7}, "dataset"),
        ({"method": True}, "method"),
    ],
)
def test_numbers_and_strings_are_strict(overrides, message):
    """A boolean is not a number (`true` once read as ε* = 1.0), a string is not a number."""
    with pytest.raises(PolicyError, match=message):
        policy_from_dict(base(**overrides))


def test_yaml_duplicate_keys_are_refused_and_exponents_are_numbers(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "policies:\n  - name: eu\n    target_epsilon: 0.5\n    target_epsilon: 50\n"
        "    target_delta: 1e-5\n    dataset: d\n    model: m\n"
    )
    with pytest.raises(PolicyError, match="duplicate key 'target_epsilon'") as raised:
        load_policies(path)
    assert "\n" not in str(raised.value)
    path.write_text(
        "policies:\n  - {name: eu, target_epsilon: 2, target_delta: 1e-5, dataset: d, model: m}\n"
    )
    (policy,) = load_policies(path)
    assert policy.target_delta == 1e-5 and policy.target_epsilon == 2.0
