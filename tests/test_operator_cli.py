"""The operator's command line: the registry found one way, read without side effects or
heavy imports, and every ``--help`` quick (README.md#the-command-line)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from commands import fresh_env

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
    """A fresh environment whose embedded state is ``./.dpmerge`` of the command's directory."""
    return {k: v for k, v in fresh_env(tmp_path).items() if k != "DPMERGE_HOME"}


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


def _fake_embedded_registry(home: Path) -> Path:
    """An embedded MLflow database with the tables ``registry ls`` reads, and no versions."""
    import sqlite3

    home.mkdir(parents=True, exist_ok=True)
    database = home / "mlflow.db"
    with sqlite3.connect(database) as db:
        db.execute(
            "CREATE TABLE model_versions (name TEXT, version INTEGER, run_id TEXT, "
            "current_stage TEXT, description TEXT)"
        )
        db.execute("CREATE TABLE model_version_tags (name TEXT, version INTEGER, key, value)")
        db.execute("CREATE TABLE registered_model_aliases (name TEXT, alias TEXT, version)")
    return database


def _stopped_stack(state_dir: Path) -> None:
    """A ``stack.json`` as ``dpmerge stack up`` records it, for a stack that is not running."""
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            ports.append(free.getsockname()[1])
    state_dir.mkdir(parents=True)
    document = {"mlflow_port": ports[0], "prefect_port": ports[1], "prefect": True}
    (state_dir / "stack.json").write_text(json.dumps(document))


def test_a_recorded_stack_that_is_down_is_named_not_replaced(tmp_path: Path) -> None:
    """The stack is down and ./.dpmerge exists: a command refuses with `dpmerge stack up`
    (exit 1) instead of answering from, or writing to, the embedded state; --home and
    --tracking-uri still choose."""
    work = tmp_path / "work"
    database = _fake_embedded_registry(work / ".dpmerge")
    env = _clean_env(tmp_path) | {"DPMERGE_STACK_DIR": str(tmp_path / "stack")}
    _stopped_stack(tmp_path / "stack")
    before = database.stat().st_mtime_ns, sorted((work / ".dpmerge").iterdir())
    policy = ["policy", "set", "--name", "eu", "--target-epsilon", "1", "--delta", "1e-5"]
    for args in (["registry", "ls"], ["registry", "show", "@policy-eu"], policy):
        result, out, err = _probe(args, work, env)
        assert result["code"] == 1 and out == "", args
        assert len(err.splitlines()) == 1 and "is not running" in err, args
        assert "bin/dpmerge stack up" in err and str(tmp_path / "stack" / "stack.json") in err
    assert (database.stat().st_mtime_ns, sorted((work / ".dpmerge").iterdir())) == before
    for args in (["--home", str(work / ".dpmerge")], ["--tracking-uri", f"sqlite:///{database}"]):
        result, out, _ = _probe(["registry", "ls", *args], work, env)
        assert result["code"] == 0, args
        assert result["heavy"] == []  # the serving pointers are read without torch or MLflow
        assert out.startswith(f"registry: sqlite:///{database} (embedded; from ")
        assert out.endswith("no dpmerge versions registered\n")


def test_every_registry_answer_names_its_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Text and JSON say which registry answered, and what kind it is: the local stack's
    MLflow is named as the stack's also when reached through $MLFLOW_TRACKING_URI (as
    ``dpmerge stack env`` sets it)."""
    from dpmerge.locate import Located

    work = tmp_path / "work"
    database = _fake_embedded_registry(work / ".dpmerge")
    result, out, _ = _probe(["registry", "ls", "--json"], work, _clean_env(tmp_path))
    assert result["code"] == 0
    assert json.loads(out) == {
        "registry": {
            "uri": f"sqlite:///{database}",
            "kind": "embedded",
            "source": f"the embedded state ({database.parent})",
        },
        "versions": [],
    }
    _stopped_stack(tmp_path / "stack")
    monkeypatch.setenv("DPMERGE_STACK_DIR", str(tmp_path / "stack"))
    port = json.loads((tmp_path / "stack" / "stack.json").read_text())["mlflow_port"]
    stack = Located.at(f"http://127.0.0.1:{port}", "$MLFLOW_TRACKING_URI")
    other = Located.at("http://127.0.0.1:1", "--tracking-uri")
    assert (stack.kind, other.kind) == ("stack", "server")
    assert stack.describe() == (
        f"registry: http://127.0.0.1:{port} (stack; from $MLFLOW_TRACKING_URI)"
    )
