"""The operator's command line: the registry found one way, read without side effects or
heavy imports, and every ``--help`` quick (docs/workflow.md#the-command-line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import json, sys, time
start = time.perf_counter()
from flows.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
print(json.dumps({"code": code, "seconds": time.perf_counter() - start,
                  "heavy": sorted(m for m in ("torch", "mlflow", "prefect") if m in sys.modules)}),
      file=sys.stderr)
"""


def _clean_env(tmp_path: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "MLFLOW_TRACKING", "DPMERGE_"))
    }
    return env | {
        "PYTHONPATH": str(REPO),
        "DPMERGE_STACK_DIR": str(tmp_path / "no-stack"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }


def _probe(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[dict, str, str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    *lines, last = done.stderr.strip().splitlines()
    return json.loads(last), done.stdout, "\n".join(lines)


def test_registry_ls_in_an_empty_directory_creates_nothing(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    result, out, err = _probe(["registry", "ls"], work, _clean_env(tmp_path))
    assert result["code"] == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("dpmerge: error: no registry found")
    for place in ("--tracking-uri", "$MLFLOW_TRACKING_URI", "stack.json", ".dpmerge/mlflow.db"):
        assert place in err
    assert list(work.iterdir()) == [] and not (tmp_path / "no-stack").exists()
    assert result["heavy"] == []  # neither torch nor MLflow (nor Prefect) imported
    missing = f"sqlite:///{work / 'other.db'}"
    result, _, err = _probe(
        ["registry", "ls", "--tracking-uri", missing], work, _clean_env(tmp_path)
    )
    assert result["code"] == 2 and "a read never creates one" in err
    assert list(work.iterdir()) == []


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["registry", "--help"],
        ["registry", "ls", "--help"],
        ["registry", "show", "--help"],
        ["policy", "--help"],
        ["policy", "set", "--help"],
        ["policy", "apply", "--help"],
        ["demo", "--help"],
        ["stack", "--help"],
    ],
)
def test_help_is_quick_and_imports_nothing_heavy(tmp_path: Path, args: list[str]) -> None:
    start = time.perf_counter()
    result, out, _ = _probe(args, tmp_path, _clean_env(tmp_path))
    assert result["code"] == 0 and out.startswith("usage: dpmerge")
    assert result["heavy"] == [], f"{args} imported {result['heavy']}"
    print(
        f"{' '.join(args)}: {result['seconds']:.2f} s in-process, "
        f"{time.perf_counter() - start:.2f} s with the interpreter"
    )


def test_policy_set_options_are_the_policy_model() -> None:
    """Every Policy field has its option, closed vocabularies are choices of the field's enum,
    and the option's help is the field's description: the two cannot drift."""
    import argparse
    from enum import StrEnum

    from dpmerge.policies import Policy
    from flows.commands.policy_options import _base_type, add_policy_options

    parser = argparse.ArgumentParser()
    add_policy_options(parser)
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert set(actions) == set(Policy.model_fields)
    for name, field in Policy.model_fields.items():
        kind = _base_type(field.annotation)
        if isinstance(kind, type) and issubclass(kind, StrEnum):
            assert actions[name].choices == [m.value for m in kind]
        assert actions[name].help.startswith(field.description)
    assert actions["target_delta"].option_strings == ["--target-delta", "--delta"]
