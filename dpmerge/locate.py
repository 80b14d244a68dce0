"""Where dpmerge's registry is: one resolution for every command (docs/design.md#workflow).

In order: an explicit ``--tracking-uri``; ``$MLFLOW_TRACKING_URI``; a *running* local stack
(its ``stack.json`` in ``$DPMERGE_STACK_DIR``, else ``.stack/`` in the repository, and its
MLflow answering); the embedded state (``$DPMERGE_HOME``, else ``./.dpmerge``). A reader never
creates a registry: when nothing is found it raises :class:`RegistryNotFoundError` saying where
it looked. Only commands that write (``demo``, an in-process ``policy set``) create the
embedded state.

This module imports neither MLflow nor torch: ``registry ls`` and every ``--help`` stay fast.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from dpmerge.environment import probe
from dpmerge.errors import InputError
from dpmerge.home import resolve_home

STACK_ENV = "DPMERGE_STACK_DIR"
STACK_FILE = "stack.json"
LOOPBACK = "127.0.0.1"
PROBE_TIMEOUT_S = 0.5


class RegistryNotFoundError(InputError):
    """No registry where dpmerge looks; the message lists the places."""


def embedded_tracking_uri(home: str | Path | None = None) -> str:
    return f"sqlite:///{resolve_home(home) / 'mlflow.db'}"


def stack_state_dir() -> Path:
    """Where ``dpmerge stack up`` keeps its state: ``$DPMERGE_STACK_DIR``, else ``.stack/`` in
    the source checkout holding this package (else in the working directory)."""
    if os.environ.get(STACK_ENV):
        return Path(os.environ[STACK_ENV]).absolute()
    checkout = Path(__file__).resolve().parents[1]
    root = checkout if (checkout / "pyproject.toml").is_file() else Path.cwd()
    return root / ".stack"


@dataclass(frozen=True)
class LocalStack:
    """A local stack found through its ``stack.json``."""

    state_dir: Path
    mlflow_url: str
    prefect_api_url: str | None
    running: bool

    @classmethod
    def find(cls, state_dir: Path | None = None) -> LocalStack | None:
        """The stack recorded in ``state_dir`` (default :func:`stack_state_dir`), with whether
        its MLflow answers now; ``None`` without a readable ``stack.json``."""
        directory = state_dir or stack_state_dir()
        try:
            saved = json.loads((directory / STACK_FILE).read_text())
            mlflow_port = int(saved["mlflow_port"])
            prefect_port = int(saved["prefect_port"]) if saved.get("prefect", True) else None
        except (OSError, ValueError, TypeError, KeyError):
            return None
        mlflow_url = f"http://{LOOPBACK}:{mlflow_port}"
        prefect_url = f"http://{LOOPBACK}:{prefect_port}/api" if prefect_port else None
        return cls(directory, mlflow_url, prefect_url, _answers(f"{mlflow_url}/health"))


def _answers(url: str) -> bool:
    return probe(url, timeout_s=PROBE_TIMEOUT_S).ok


@dataclass(frozen=True)
class Located:
    """The tracking URI a command uses, and where it came from (``source``, for messages)."""

    tracking_uri: str
    source: str
    stack: LocalStack | None = None

    @property
    def embedded(self) -> bool:
        return self.tracking_uri.startswith("sqlite:///")


def locate_registry(
    tracking_uri: str | None = None, *, home: str | Path | None = None, create: bool = False
) -> Located:
    """Resolve the registry (see the module docstring). ``home`` (a ``--home`` flag) chooses
    the embedded state outright. With ``create`` the embedded state may be new (a command that
    writes); without it, a missing database is :class:`RegistryNotFoundError`."""
    looked = []
    if tracking_uri:
        return _existing(Located(tracking_uri, "--tracking-uri"), create)
    looked.append("--tracking-uri (not given)")
    if home is None:
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return _existing(
                Located(os.environ["MLFLOW_TRACKING_URI"], "$MLFLOW_TRACKING_URI"), create
            )
        looked.append("$MLFLOW_TRACKING_URI (not set)")
        stack = LocalStack.find()
        if stack is not None and stack.running:
            return Located(stack.mlflow_url, f"the local stack ({stack.state_dir})", stack)
        where = stack_state_dir() / STACK_FILE
        looked.append(
            f"a local stack ({where}: "
            + ("MLflow not answering)" if stack is not None else "none)")
        )
    uri = embedded_tracking_uri(home)
    located = Located(uri, f"the embedded state ({resolve_home(home)})")
    if create or _sqlite_path(uri).is_file():
        return located
    looked.append(f"the embedded state ({_sqlite_path(uri)}: none)")
    raise RegistryNotFoundError(
        "no registry found; looked at " + ", ".join(looked) + ". Create one with "
        f"`{command('demo')}` (embedded) or `{command('stack', 'up')}` (the local stack), or "
        "pass --tracking-uri"
    )


def _sqlite_path(uri: str) -> Path:
    return Path(uri.removeprefix("sqlite:///"))


def _existing(located: Located, create: bool) -> Located:
    """An explicit ``sqlite:///`` URI must name an existing file unless ``create``."""
    if located.embedded and not create and not _sqlite_path(located.tracking_uri).is_file():
        raise RegistryNotFoundError(
            f"no MLflow database at {_sqlite_path(located.tracking_uri)} (from {located.source}); "
            "a read never creates one"
        )
    return located


def command(*words: str, tool: str = "dpmerge") -> str:
    """A command line that works from the working directory: ``tool`` beside this Python
    (the virtual environment's ``bin/``), relative when it lies below the working directory."""
    path = Path(sys.executable).parent / tool
    try:
        shown = str(path.relative_to(Path.cwd()))
    except ValueError:
        shown = str(path)
    return " ".join([shown, *words])
