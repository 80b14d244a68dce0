"""Strict input, end to end: every bad input below, run as the console script in a fresh
process, ends with exactly one line on stderr, no traceback, the documented exit status, and
echoes nothing raw (README, "The command line"; docs/design.md#policies)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from commands import fresh_env
from factories import make_record

from dpmerge.policies import PolicyError, policy_from_dict
from dpmerge.registry.tags import ALIAS_LIMIT

RECORD = make_record("c1", 1.0).model_dump(mode="json", exclude_none=True)
POLICY = {"name": "eu", "target_epsilon": 2.0, "target_delta": 1e-5, "dataset": "digits"}


def _policy_yaml(**fields: object) -> str:
    body = "\n".join(f"    {key}: {json.dumps(value)}" for key, value in fields.items())
    return f"policies:\n  - model: logreg\n{body}\n"


def _inputs(tmp: Path) -> dict[str, tuple[list[str], int, str]]:
    """name → (arguments, exit status, what the one line must say)."""
    files = {
        # Python's json keeps the last value: σ 1.0 then 50 would be analysed as 50
        "dup.json": '{"candidates": [{"noise_multiplier": 1.0, '
        + json.dumps({**RECORD, "noise_multiplier": 50.0})[1:]
        + "]}",
        "escape.json": json.dumps(
            {"candidates": [{**RECORD, "name": "\x1b[2Jevil\r", "steps": "many"}]}
        ),
        "typo.json": json.dumps(
            {"candidates": [{k if k != "clip_norm" else "clip_nrom": v for k, v in RECORD.items()}]}
        ),
        "typo-sigma.json": json.dumps(
            {
                "candidates": [
                    {
                        k if k != "noise_multiplier" else "noise_multipler": v
                        for k, v in RECORD.items()
                    }
                ]
            }
        ),
        "top.json": json.dumps({"candidates": [RECORD], "candidate": []}),
        "typo.yaml": _policy_yaml(**{**POLICY, "target_epsilom": 1.0}),
        "top.yaml": _policy_yaml(**POLICY) + "dry_run: true\n",
        "latest.yaml": _policy_yaml(**POLICY, alias="LATEST"),
        "long.yaml": _policy_yaml(**POLICY, alias="a" * 240),
    }
    for name, text in files.items():
        (tmp / name).write_text(text)
    account = ["account", "--method", "rs", "--weights", "1", "--delta", "1e-5", "--candidates"]
    policy_set = ["policy", "set", "--name", "eu", "--dry-run", "--delta", "1e-5"]
    return {
        "duplicate JSON key": (
            [*account, str(tmp / "dup.json")],
            2,
            "duplicate key 'noise_multiplier' in the object named 'c1'",
        ),
        "control characters echoed": (
            [*account, str(tmp / "escape.json")],
            2,
            "candidate '\\x1b[2Jevil\\r'",
        ),
        "control characters in an option": (
            [*policy_set, "--target-epsilon", "1", "--alias", "a\x1b]0;pwned\x07"],
            2,
            "alias 'a\\x1b]0;pwned\\x07' is not a valid registry alias",
        ),
        "control characters in a file name": (
            ["policy", "apply", "-f", str(tmp / "no\x1b[2J\x1b[Hsuch.yaml")],
            2,
            "no\\x1b[2J\\x1b[Hsuch.yaml",
        ),
        "control characters in an argument": (
            ["registry", "show", "a", "b\x1b[31m"],
            2,
            "unrecognized arguments: b\\x1b[31m",
        ),
        "repeated option": (
            ["policy", "set", "--name", "eu", "--target-epsilon", "1", "--target-epsilon", "5"],
            2,
            "option --target-epsilon given more than once; give it once",
        ),
        "one option under two spellings": (
            [*policy_set[:-2], "--target-epsilon", "1", "--delta", "1e-5", "--target-delta", "1"],
            2,
            "option --target-delta given more than once (already given as --delta)",
        ),
        "repeated option of a library command": (
            [*account, str(tmp / "dup.json"), "--delta", "1e-6"],
            2,
            "option --delta given more than once",
        ),
        "flag typo": (
            ["policy", "set", "--name", "eu", "--target-epsilom", "1", "--delta", "1e-5"],
            2,
            "unknown option --target-epsilom; did you mean --target-epsilon?",
        ),
        "abbreviated flag": (
            [*policy_set, "--target", "1"],
            2,
            "unknown option --target; did you mean",
        ),
        "candidate key typo": (
            [*account, str(tmp / "typo.json")],
            2,
            "unknown field 'clip_nrom'; did you mean 'clip_norm'?",
        ),
        "candidate key typo of its kind": (
            [*account, str(tmp / "typo-sigma.json")],
            2,
            "unknown field 'noise_multipler'; did you mean 'noise_multiplier'?",
        ),
        "candidates file top-level key": (
            [*account, str(tmp / "top.json")],
            2,
            "top level: unknown field 'candidate'; did you mean 'candidates'?",
        ),
        "policy key typo": (
            ["policy", "apply", "-f", str(tmp / "typo.yaml")],
            2,
            "unknown field 'target_epsilom'; did you mean 'target_epsilon'?",
        ),
        "policies file top-level key": (
            ["policy", "apply", "-f", str(tmp / "top.yaml")],
            2,
            "top level: unknown field 'dry_run' (only 'policies' is read)",
        ),
        "alias LATEST": (
            ["policy", "apply", "-f", str(tmp / "latest.yaml")],
            2,
            "alias 'LATEST' is not a valid registry alias",
        ),
        "alias too long": (
            ["policy", "apply", "-f", str(tmp / "long.yaml")],
            2,
            f"is 240 characters long; the registry takes at most {ALIAS_LIMIT}",
        ),
        "a file tracking store": (
            ["registry", "ls", "--tracking-uri", "file:///etc"],
            2,
            "opening the registry at file:///etc",
        ),
        "a device as a policies file": (
            ["policy", "apply", "-f", "/dev/zero"],
            2,
            "policy file /dev/zero is not a regular file",
        ),
    }


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("bad-inputs")
    return tmp, _inputs(tmp)


NAMES = [
    "duplicate JSON key",
    "control characters echoed",
    "control characters in an option",
    "control characters in a file name",
    "control characters in an argument",
    "repeated option",
    "one option under two spellings",
    "repeated option of a library command",
    "flag typo",
    "abbreviated flag",
    "candidate key typo",
    "candidate key typo of its kind",
    "candidates file top-level key",
    "policy key typo",
    "policies file top-level key",
    "alias LATEST",
    "alias too long",
    "a file tracking store",
    "a device as a policies file",
]


@pytest.mark.parametrize("name", NAMES)
def test_a_bad_input_is_one_escaped_line(name: str, bad_inputs: tuple[Path, dict]) -> None:
    tmp, inputs = bad_inputs
    args, status, says = inputs[name]
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=tmp,
        env=fresh_env(tmp),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == status, done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("dpmerge: error: ")
    assert says in done.stderr
    assert done.stderr[:-1].isprintable()  # nothing raw echoed
    assert not (tmp / "home").exists()  # nothing created


def test_every_bad_input_is_run(bad_inputs: tuple[Path, dict]) -> None:
    assert sorted(NAMES) == sorted(bad_inputs[1])


@pytest.mark.parametrize(
    "alias", ["latest", "LATEST", "Latest", "v3", "V12", "a" * (ALIAS_LIMIT + 1)]
)
def test_aliases_mlflow_or_the_registry_would_refuse_are_refused_first(alias: str) -> None:
    """What MLflow's own alias validation refuses (``latest`` in any case, ``v<digits>``, over
    255 characters) and what would not fit the registry's ``dp.alias_*.<alias>`` tag keys."""
    with pytest.raises(PolicyError, match="alias"):
        policy_from_dict({**POLICY, "model": "logreg", "alias": alias})


def test_the_alias_limits_mirror_mlflow() -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.utils import validation

    from dpmerge.registry.tags import MLFLOW_ALIAS_LIMIT, MLFLOW_TAG_KEY_LIMIT, SERVED_TAG

    assert validation.MAX_REGISTERED_MODEL_ALIAS_LENGTH == MLFLOW_ALIAS_LIMIT
    assert validation.MAX_MODEL_REGISTRY_TAG_KEY_LENGTH == MLFLOW_TAG_KEY_LIMIT
    longest = policy_from_dict({**POLICY, "model": "logreg", "alias": "a" * ALIAS_LIMIT}).alias
    assert longest is not None
    validation._validate_model_alias_name(longest)  # MLflow accepts the longest we accept
    validation._validate_model_alias_name_reserved(longest)
    validation._validate_length_limit(
        "tag key", validation.MAX_MODEL_REGISTRY_TAG_KEY_LENGTH, SERVED_TAG + longest
    )
    for refused in ("LATEST", "v3"):
        with pytest.raises(MlflowException):
            validation._validate_model_alias_name_reserved(refused)
