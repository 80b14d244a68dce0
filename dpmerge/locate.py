"""Where dpmerge's registry is: one resolution for every command (docs/design.md#workflow).

In order: an explicit ``--tracking-uri`` (or ``--home``, which chooses the embedded state
outright); ``$MLFLOW_TRACKING_URI``; the local stack (its ``stack.json`` in
``$DPMERGE_STACK_DIR``, else ``.stack/`` in the repository); the embedded state
(``$DPMERGE_HOME``, else ``./.dpmerge``). A stack that is recorded but not running is an error
(:class:`StackNotRunningError`, naming ``dpmerge stack up``), never a silent fall back to the
embedded state: the two hold different releases. A reader never creates a registry: when
nothing is found it raises :class:`RegistryNotFoundError` saying where it looked. Only commands
that write (``demo``, an in-process ``policy set``) create the embedded state.

Every command that touches a registry names the one it used, in its text
(:meth:`Located.describe`) and its JSON (:meth:`Located.to_dict`): the URI, its
:class:`~dpmerge.vocabulary.RegistryKind` and where it came from.

This module imports neither MLflow nor torch: ``registry ls`` and every ``--help`` stay fast.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from dpmerge.environment import probe
from dpmerge.errors import InputError, OutageError
from dpmerge.home import resolve_home
from dpmerge.vocabulary import RegistryKind

STACK_ENV = "DPMERGE_STACK_DIR"
STACK_FILE = "stack.json"
LOOPBACK = "127.0.0.1"
PROBE_TIMEOUT_S = 3.0
"""How long a recorded stack's MLflow may take to answer its health check. A stopped stack
refuses the connection at once; a running one on a loaded machine may be slow, and reading it
as stopped would refuse the command."""


class RegistryNotFoundError(InputError):
    """No registry where dpmerge looks; the message lists the places."""


class StackNotRunningError(OutageError):
    """A local stack is recorded (its ``stack.json``) but its MLflow does not answer. The
    command refuses instead of using the embedded state, which holds other releases."""


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
    def find(cls, state_dir: Path | None = None, *, probe_mlflow: bool = True) -> LocalStack | None:
        """The stack recorded in ``state_dir`` (default :func:`stack_state_dir`), with whether
        its MLflow answers now (``running``; without ``probe_mlflow`` it is not asked, and
        ``running`` is ``False``); ``None`` without a readable ``stack.json``."""
        directory = state_dir or stack_state_dir()
        try:
            saved = json.loads((directory / STACK_FILE).read_text())
            mlflow_port = int(saved["mlflow_port"])
            prefect_port = int(saved["prefect_port"]) if saved.get("prefect", True) else None
        except (OSError, ValueError, TypeError, KeyError):
            return None
        mlflow_url = f"http://{LOOPBACK}:{mlflow_port}"
        prefect_url = f"http://{LOOPBACK}:{prefect_port}/api" if prefect_port else None
        running = probe_mlflow and _answers(f"{mlflow_url}/health")
        return cls(directory, mlflow_url, prefect_url, running)


def _answers(url: str) -> bool:
    return probe(url, timeout_s=PROBE_TIMEOUT_S).ok


@dataclass(frozen=True)
class Located:
    """The tracking URI a command uses, what kind of registry it is, and where it came from
    (``source``, for messages). Build it with :meth:`at`."""

    tracking_uri: str
    source: str
    kind: RegistryKind
    stack: LocalStack | None = None

    @classmethod
    def at(cls, tracking_uri: str, source: str, stack: LocalStack | None = None) -> Located:
        """``tracking_uri`` with its kind: the stack's when it is the recorded stack's MLflow
        (also when reached through ``$MLFLOW_TRACKING_URI``, as ``dpmerge stack env`` sets it),
        embedded for a sqlite file, else a server."""
        if stack is not None or tracking_uri.rstrip("/") == _recorded_mlflow_url():
            kind = RegistryKind.STACK
        elif tracking_uri.startswith("sqlite:///"):
            kind = RegistryKind.EMBEDDED
        else:
            kind = RegistryKind.SERVER
        return cls(tracking_uri, source, kind, stack)

    @property
    def embedded(self) -> bool:
        return self.tracking_uri.startswith("sqlite:///")

    def describe(self) -> str:
        """The line a command prints: ``registry: <uri> (<kind>; from <source>)``."""
        return f"registry: {self.tracking_uri} ({self.kind}; from {self.source})"

    def to_dict(self) -> dict[str, str]:
        """What a command's JSON carries under ``"registry"``."""
        return {"uri": self.tracking_uri, "kind": str(self.kind), "source": self.source}


def _recorded_mlflow_url() -> str | None:
    """The recorded local stack's MLflow URL (read from its ``stack.json``, not probed)."""
    stack = LocalStack.find(probe_mlflow=False)
    return stack.mlflow_url if stack is not None else None


def is_stack_registry(tracking_uri: str) -> bool:
    """Whether ``tracking_uri`` is the recorded local stack's MLflow (whose release state is
    in the stack's S3, never in a local home)."""
    if not tracking_uri.startswith(("http://", "https://")):  # embedded: no file to read
        return False
    recorded = _recorded_mlflow_url()
    return recorded is not None and tracking_uri.rstrip("/") == recorded.rstrip("/")


def locate_registry(
    tracking_uri: str | None = None, *, home: str | Path | None = None, create: bool = False
) -> Located:
    """Resolve the registry (see the module docstring). ``home`` (a ``--home`` flag) chooses
    the embedded state outright. With ``create`` the embedded state may be new (a command that
    writes); without it, a missing database is :class:`RegistryNotFoundError`. A recorded stack
    whose MLflow does not answer is :class:`StackNotRunningError`."""
    looked = []
    if tracking_uri:
        return _existing(Located.at(tracking_uri, "--tracking-uri"), create)
    looked.append("--tracking-uri (not given)")
    if home is None:
        if os.environ.get("MLFLOW_TRACKING_URI"):
            found = Located.at(os.environ["MLFLOW_TRACKING_URI"], "$MLFLOW_TRACKING_URI")
            return _existing(found, create)
        looked.append("$MLFLOW_TRACKING_URI (not set)")
        stack = LocalStack.find()
        where = stack_state_dir() / STACK_FILE
        if stack is not None:
            if not stack.running:
                raise StackNotRunningError(
                    f"the local stack recorded in {stack.state_dir / STACK_FILE} is not running "
                    f"(its MLflow at {stack.mlflow_url} does not answer): start it with "
                    f"`{command('stack', 'up')}`, or choose a registry with --tracking-uri "
                    "(or --home for the embedded state)"
                )
            return Located.at(stack.mlflow_url, f"the local stack ({where})", stack)
        looked.append(f"a local stack ({where}: none)")
    home_path = resolve_home(home)
    uri = embedded_tracking_uri(home_path)
    located = Located.at(uri, f"the embedded state ({home_path})")
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
