"""Exit statuses come from an error's type through one table (dpmerge.exits; README,
"Outcomes"): 1 an outage or a bug, 2 bad input or a refusal, 3 infeasible, 4 not promoted,
130 Ctrl-C. Errors are classified where they arise, never from their text."""

from __future__ import annotations

import importlib
import pkgutil
import re
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from commands import REPO, fresh_env
from factories import make_record

import dpmerge
from dpmerge.accounting.records import PrivacyLabel
from dpmerge.errors import DPMergeError
from dpmerge.exits import exit_code
from dpmerge.registry.catalog import SqliteCatalog
from dpmerge.registry.errors import RegistryError, RegistryUnavailableError
from dpmerge.vocabulary import ExitCode

EXPECTED = {
    # bad input or a refusal: one line, nothing changed
    "DPMergeError": ExitCode.REFUSED,
    "InputError": ExitCode.REFUSED,
    "RecordError": ExitCode.REFUSED,
    "ModelFactoryError": ExitCode.REFUSED,
    "FactoryMismatchError": ExitCode.REFUSED,
    "RefusalError": ExitCode.REFUSED,
    "UnsupportedError": ExitCode.REFUSED,
    "IntegrityError": ExitCode.REFUSED,
    "DatasetError": ExitCode.REFUSED,
    "BaseModelError": ExitCode.REFUSED,
    "DifferentBasesError": ExitCode.REFUSED,
    "AccessError": ExitCode.REFUSED,
    "TrainingConfigError": ExitCode.REFUSED,
    "NoCandidatesError": ExitCode.REFUSED,
    "ReleaseSignatureError": ExitCode.REFUSED,
    "ServingStatementError": ExitCode.REFUSED,
    "StateConflictError": ExitCode.REFUSED,
    "StateIntegrityError": ExitCode.REFUSED,
    "LedgerIntegrityError": ExitCode.REFUSED,
    "PolicyError": ExitCode.REFUSED,
    "RegistryNotFoundError": ExitCode.REFUSED,
    "StudyConfigError": ExitCode.REFUSED,
    "SecretKeyError": ExitCode.REFUSED,
    "DeltaError": ExitCode.REFUSED,
    "RegistryError": ExitCode.REFUSED,
    "RegistryPermissionError": ExitCode.REFUSED,
    "AliasOwnershipError": ExitCode.REFUSED,
    "RecordIntegrityError": ExitCode.REFUSED,
    "StorageError": ExitCode.REFUSED,
    "ObjectNotFoundError": ExitCode.REFUSED,
    "ObjectExistsError": ExitCode.REFUSED,
    "ObjectChangedError": ExitCode.REFUSED,
    "UnreadableObjectError": ExitCode.REFUSED,
    # an outage (or a bug)
    "OutageError": ExitCode.FAILURE,
    "TransientError": ExitCode.FAILURE,
    "StorageUnavailableError": ExitCode.FAILURE,
    "RegistryFailureError": ExitCode.FAILURE,
    "RegistryUnavailableError": ExitCode.FAILURE,
    "StackNotRunningError": ExitCode.FAILURE,
    "BoundContradictionError": ExitCode.FAILURE,
    "RequestWaitError": ExitCode.FAILURE,
    # outcomes
    "InfeasibleTargetError": ExitCode.INFEASIBLE,
    "NotPromotedError": ExitCode.NOT_PROMOTED,
    "GateError": ExitCode.NOT_PROMOTED,
}
"""Every error class of the library, with the status it must give. A new class fails
:func:`test_every_library_error_has_a_decided_exit_code` until it is added here."""


def _library_errors() -> dict[str, type[DPMergeError]]:
    for module in pkgutil.walk_packages(dpmerge.__path__, "dpmerge."):
        importlib.import_module(module.name)
    found: dict[str, type[DPMergeError]] = {}
    pending = [DPMergeError]
    while pending:
        kind = pending.pop()
        if kind.__module__.startswith("dpmerge"):
            found[kind.__name__] = kind
        pending.extend(kind.__subclasses__())
    return found


def test_every_library_error_has_a_decided_exit_code() -> None:
    errors = _library_errors()
    assert sorted(errors) == sorted(EXPECTED), "decide the exit code of a new error type here"
    for name, kind in errors.items():
        assert exit_code(kind.__new__(kind)) == EXPECTED[name], name
    assert exit_code(KeyboardInterrupt()) == ExitCode.INTERRUPTED
    assert exit_code(BrokenPipeError()) == ExitCode.BROKEN_PIPE
    assert exit_code(RuntimeError("a bug")) == ExitCode.FAILURE


_ERROR = r"(?:e|err|error|exc|exception|problem|cause|failure)\w*"
CLASSIFIED_BY_TEXT = re.compile(
    rf"""in\s+str\(\s*{_ERROR}\s*\)"""  # "locked" in str(error)
    rf"""|str\(\s*{_ERROR}\s*\)\s*\.\s*(startswith|endswith|lower|find|index|split)"""
    r"""|\.args\s*\[\s*0\s*\]"""  # matching an exception's first argument
    r"""|["'][^"'\n]*["']\s+(not\s+)?in\s+(\w+\.)?"""  # "…" in message
    r"""(message|msg|text|body|reason|stderr|err|error|exc|problem)\b"""
    r"""|re\.(search|match|fullmatch)\([^)]*\b(error|exc|message|msg|body|reason)\b"""
)
"""Ways to decide what an error is from its text rather than its type, code or status."""


def test_no_error_is_classified_by_its_message_text() -> None:
    offenders = []
    for package in ("dpmerge", "flows", "tasks", "devstack"):
        for path in sorted((REPO / package).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if CLASSIFIED_BY_TEXT.search(line.split("#", 1)[0]):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []


def test_the_text_check_finds_what_it_forbids() -> None:
    """The pattern above catches the forms it is meant to (or the test above proves nothing)."""
    forbidden = [
        'if "locked" in str(error) or "busy" in str(error):',
        'if error.code == 404 and "RESOURCE_DOES_NOT_EXIST" in body:',
        "if error.args[0] == 'no such table':",
        "elif str(exc).startswith('timed out'):",
        "if re.search('refused', message):",
    ]
    allowed = [
        'if error.error_code == "RESOURCE_ALREADY_EXISTS":',
        'if str(column).startswith("epsilon") and isinstance(value, float):',
        "if code is not None and code & 0xFF in SQLITE_BUSY_CODES:",
    ]
    assert all(CLASSIFIED_BY_TEXT.search(line) for line in forbidden)
    assert not any(CLASSIFIED_BY_TEXT.search(line) for line in allowed)


def _free_port() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def _dpmerge(*args: str, **options: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **options,
    )


def test_an_unreachable_mlflow_is_an_outage_not_bad_input(tmp_path: Path) -> None:
    """README: exit 1 for an outage; exit 2 is for rejected input."""
    uri = f"http://127.0.0.1:{_free_port()}"
    done = _dpmerge("registry", "ls", "--tracking-uri", uri, env=fresh_env(tmp_path))
    out, err = done.communicate(timeout=120)
    assert done.returncode == ExitCode.FAILURE, err
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"dpmerge: error: MLflow server {uri} unreachable")


def _as_a_terminal_would() -> None:
    """A shell's foreground command takes Ctrl-C; a background one (``nohup … &``, how a CI
    runner may start the suite) inherits SIGINT ignored, and Python then keeps ignoring it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_ends_with_one_line_and_130(tmp_path: Path) -> None:
    """Ctrl-C while a command waits on a server that accepted but never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        uri = f"http://127.0.0.1:{server.getsockname()[1]}"
        command = _dpmerge(
            "registry",
            "ls",
            "--tracking-uri",
            uri,
            env=fresh_env(tmp_path),
            preexec_fn=_as_a_terminal_would,
        )
        server.settimeout(120)
        connection, _ = server.accept()  # the command is now waiting for an answer
        with connection:
            command.send_signal(signal.SIGINT)
            out, err = command.communicate(timeout=60)
    assert command.returncode == ExitCode.INTERRUPTED, err[-3000:]
    assert out == "" and err == "dpmerge: interrupted\n"


def test_a_busy_sqlite_registry_is_told_by_its_result_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sqlite's result code decides, whatever the message says."""
    database = tmp_path / "mlflow.db"
    database.touch()
    catalog = SqliteCatalog(f"sqlite:///{database}")

    def failing(code: int, text: str) -> Any:
        def connect(*args: Any, **kwargs: Any) -> Any:
            error = sqlite3.OperationalError(text)
            error.sqlite_errorcode = code
            raise error

        return connect

    monkeypatch.setattr(sqlite3, "connect", failing(sqlite3.SQLITE_BUSY, "something else"))
    with pytest.raises(RegistryUnavailableError):
        catalog.aliases("m")
    monkeypatch.setattr(sqlite3, "connect", failing(261, "no text at all"))  # SQLITE_BUSY_RECOVERY
    with pytest.raises(RegistryUnavailableError):
        catalog.aliases("m")
    monkeypatch.setattr(sqlite3, "connect", failing(sqlite3.SQLITE_CORRUPT, "database is locked"))
    with pytest.raises(RegistryError) as corrupt:
        catalog.aliases("m")
    assert type(corrupt.value) is RegistryError and exit_code(corrupt.value) == ExitCode.REFUSED


def test_priming_caches_skips_a_label_without_a_pld(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An RDP-only label has no PLD: ``candidate_pld`` says so with ``UnsupportedError`` (not a
    ``ValueError``), and priming the merge caches goes on without it."""
    from types import SimpleNamespace

    from dpmerge.accounting import pld
    from dpmerge.policy_merge import preparation
    from dpmerge.workspace import Workspace

    label = PrivacyLabel(
        name="vendor", dataset="fashion-mnist:test", rdp_orders=(2.0, 8.0), rdp_epsilons=(0.1, 1)
    )
    record = make_record("own", 2.0, steps=10)
    loaded = [SimpleNamespace(model_dir=SimpleNamespace(record=r)) for r in (record, label)]
    computed = []
    monkeypatch.setattr(Workspace, "registry", lambda self: None)
    monkeypatch.setattr(Workspace, "use_caches", lambda self: None)
    monkeypatch.setattr(preparation, "find_candidates", lambda *a: "pool")
    monkeypatch.setattr(preparation, "load_candidates", lambda *a, **k: loaded)
    monkeypatch.setattr(preparation, "load_evaluation_data", lambda *a, **k: None)
    real = pld.candidate_pld
    monkeypatch.setattr(pld, "candidate_pld", lambda c, d: computed.append(c.name) or real(c, d))
    workspace = Workspace("sqlite:///unused", tmp_path)
    assert preparation.prime_caches(workspace, "fashion-mnist", "logreg") == "pool"
    assert computed == ["own", "own", "vendor", "vendor"]
