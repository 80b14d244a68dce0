"""Policies are strict data: a bad policy names its field and changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpmerge.policies import EVALUATION_EPSILON, PolicyError, load_policies, policy_from_dict

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
    assert policy.on_noncompliant == "revoke"
    assert policy.method == "auto"
    assert policy.alias == "policy-eu"
    assert policy.evaluation_epsilon == EVALUATION_EPSILON == 1.0  # the test rows' ε
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
        ({"evaluation_epsilon": 0.0}, "evaluation_epsilon"),
        ({"evaluation_epsilon": -1.0}, "evaluation_epsilon"),
        ({"evaluation_epsilon": float("inf")}, "evaluation_epsilon"),
        ({"evaluation_epsilon": float("nan")}, "evaluation_epsilon"),
        ({"on_noncompliant": "ignore"}, "on_noncompliant"),
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
        ({"evaluation_epsilon": True}, "evaluation_epsilon"),
        ({"evaluation_epsilon": "0.5"}, "evaluation_epsilon"),
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
    with pytest.raises(
        PolicyError, match="line 4, column 5: duplicate key 'target_epsilon'"
    ) as raised:
        load_policies(path)
    assert "\n" not in str(raised.value)
    path.write_text(
        "policies:\n  - {name: eu, target_epsilon: 2, target_delta: 1e-5, dataset: d, model: m}\n"
    )
    (policy,) = load_policies(path)
    assert policy.target_delta == 1e-5 and policy.target_epsilon == 2.0


@pytest.mark.parametrize("field", ["name", "dataset", "alias", "target_epsilon"])
def test_an_alias_bomb_is_refused_in_one_short_line(tmp_path, field):
    """A YAML "billion laughs" (each level ten aliases of the one below: 10^9 leaves) in any
    field is refused at once, and the error echoes a few characters of it, not gigabytes."""
    import time

    levels = ["      - &a0 [x, x, x, x, x, x, x, x, x, x]"] + [
        f"      - &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)
    ]
    policy = {"name": "eu", "target_epsilon": 2, "target_delta": "1e-5", "dataset": "d"}
    policy[field] = "*a8"
    items = "".join(f"    {k}: {v}\n" for k, v in {**policy, "model": "m"}.items())
    path = tmp_path / "bomb.yaml"  # the anchors inside the policy: no other top-level key
    path.write_text("policies:\n  - anchors:\n" + "\n".join(levels) + "\n" + items)
    start = time.perf_counter()
    with pytest.raises(PolicyError, match=field) as raised:
        load_policies(path)
    assert time.perf_counter() - start < 5
    message = str(raised.value)
    assert "\n" not in message and len(message) < 400


def test_long_values_are_cut_in_errors():
    with pytest.raises(PolicyError) as raised:
        policy_from_dict(base(name="N" * 100_000))
    assert len(str(raised.value)) < 400
    with pytest.raises(PolicyError) as raised:
        policy_from_dict(base(alias="a b" * 50_000))
    assert len(str(raised.value)) < 400


def test_a_policy_must_target_registered_candidates():
    from dpmerge.policies import check_registered
    from dpmerge.registry.catalog import Inventory

    inventory = Inventory(
        "sqlite:///x.db",
        {("fashion-mnist-sha256:0123abcd", "logreg"): 5, ("digits-sha256:99", "logreg"): 3},
    )
    check_registered([policy_from_dict(base())], inventory)
    check_registered([policy_from_dict(base(dataset="fashion-mnist-sha256:0123abcd"))], inventory)
    with pytest.raises(PolicyError) as typo:
        check_registered([policy_from_dict(base(dataset="fashion-mnst"))], inventory)
    assert str(typo.value) == (
        "policy 'eu': field 'dataset': no ready logreg candidates on 'fashion-mnst' at "
        "sqlite:///x.db; choose one of: 'digits', 'fashion-mnist'"
    )
    with pytest.raises(PolicyError, match=r"field 'model'.*choose one of: 'logreg'"):
        check_registered([policy_from_dict(base(model="cnn"))], inventory)
