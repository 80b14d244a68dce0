"""Real servers on loopback for integration tests, started through ``devstack``.

``running_stack(state_dir, prefect=False)`` gives S3 (SeaweedFS), PostgreSQL and an MLflow
server (its auth app; artifacts proxied to ``s3://dpmerge/mlartifacts``); ``prefect=True`` adds
the Prefect server, the ``cpu`` and ``gpu`` process pools, one worker each and the policy
dispatcher. Ports are picked free on 127.0.0.1, so tests never collide with a developer's own
stack on the default ports. Every stack of a test session gets the same generated credentials
(:func:`session_secrets`), so one role's environment (:func:`credentials_env`) works against
each of them, and the workflow's key is the session's ``$DPMERGE_SECRET_KEY`` (tests/conftest.py)
— which the workers do not inherit: they read it from the stack's key file, as in production.

:class:`Shell` is a user's shell that holds one role's environment — what ``eval "$(dpmerge
stack env --role ROLE)"`` exports — and nothing else of this process (no workflow credentials,
no key, its own ``HOME``). :func:`policy_stack` is the workflow's stack with the deployments of
deployments/prefect.yaml applied and digits candidates trained by the ``train-candidates``
deployment: the operator, consumer and red-team tests share one per session.
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

import devstack
from devstack import credentials
from devstack.config import PortInUseError, ServiceStartError
from dpmerge.keys import KEY_ENV
from dpmerge.vocabulary import StackRole

ROLE_SECRETS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "AWS_ACCESS_KEY_ID")
ROLE_SECRETS += ("AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "DPMERGE_MLFLOW_READERS")
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RUN_TIMEOUT_S = 900
"""The longest a flow run may take before a test gives up on it (generous: CI runs at load 8)."""
DIGITS_SIGMAS = (1.0, 1.6, 3.0)


SECRETS_HOME_ENV = "DPMERGE_TEST_SECRETS_HOME"
"""Names the session's secrets home to the pytest-xdist workers: the controller makes it when
it loads conftest.py, before it starts the workers, which inherit its environment — so every
worker's stacks and its own process hold one key and one set of logins."""


@cache
def session_secrets() -> Path:
    """A secrets directory generated once per test session (0700, removed at exit by the
    process that made it), shared by all of the session's pytest-xdist workers."""
    inherited = os.environ.get(SECRETS_HOME_ENV)
    if inherited and Path(inherited).is_dir():
        return credentials.secrets_dir(Path(inherited))
    home = Path(tempfile.mkdtemp(prefix="dpmerge-test-secrets-"))
    atexit.register(shutil.rmtree, home, True)
    credentials.ensure(home)
    credentials.workflow_key(home)
    os.environ[SECRETS_HOME_ENV] = str(home)
    return credentials.secrets_dir(home)


def session_key() -> str:
    """The workflow key of every stack of this session (its 0600 key file)."""
    return credentials.workflow_key(session_secrets().parent)


def seed_secrets(state_dir: Path) -> None:
    """Give a new stack the session's credentials (an existing stack keeps its own)."""
    target = credentials.secrets_dir(state_dir)
    if not target.exists():
        shutil.copytree(session_secrets(), target)


def flow_source(name: str, text: str) -> Path:
    """A directory holding the flow file ``name`` (``text``) that the stack's worker user can
    read, unlike a test's 0700 ``tmp_path`` (docs/stack.md#worker-user); removed at exit."""
    directory = Path(tempfile.mkdtemp(prefix="dpmerge-flow-"))
    atexit.register(shutil.rmtree, directory, True)
    directory.chmod(0o755)
    (directory / name).write_text(text)
    return directory


WORKER_QUERY_S = 2.0
"""How often the test stacks' workers ask Prefect for runs (the stack's default: 0.5 s). Each ask
costs the Prefect server about 23 ms of CPU, so two workers at 0.5 s keep 0.09 of a core busy
on a stack doing nothing: on the 2-core CI machine, beside a second stack and the suite, that
CPU is worth more than a run picked up 0.75 s sooner on average (nothing here times it;
benchmarks/bench_time_to_policy.py does, on the default)."""


@contextmanager
def running_stack(
    state_dir: Path, *, prefect: bool, **fields: Any
) -> Iterator[devstack.StackConfig]:
    """Start a stack on free ports and stop it (workers first) on exit, even after a failure.
    supervisord starts without this process's ``$DPMERGE_SECRET_KEY``, so the workers and the
    dispatcher read the key from its file.

    A service that started but did not turn healthy in time (:class:`ServiceStartError`), or a
    port taken between picking it and starting its service (:class:`PortInUseError`: the
    stacks of several xdist workers pick their ports at the same moment, and another process
    may bind one first), gets what the error tells an operator to do, once: ``up`` again — here
    on new ports in a new state directory — with a warning that carries the first error and its
    reason, so the retry shows in the run's summary."""
    fields.setdefault("worker_query_seconds", WORKER_QUERY_S)
    config = devstack.StackConfig.on_free_ports(state_dir, prefect=prefect, **fields)
    seed_secrets(config.state_dir)
    try:
        with without(KEY_ENV):
            try:
                devstack.up(config)
            except (ServiceStartError, PortInUseError) as error:
                warnings.warn(f"the test stack started again on new ports: {error}", stacklevel=1)
                retry = state_dir.with_name(f"{state_dir.name}-again")
                config = devstack.StackConfig.on_free_ports(retry, prefect=prefect, **fields)
                seed_secrets(config.state_dir)
                devstack.up(config)
        yield config
    finally:
        devstack.down(config)


def credentials_env(config: devstack.StackConfig, role: StackRole) -> dict[str, str]:
    """``role``'s credentials without any server address (the same for every session stack)."""
    env = config.client_env(role)
    return {k: v for k, v in env.items() if k in ROLE_SECRETS}


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block and restore the previous values after."""
    previous = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        _restore(previous)


@contextmanager
def without(*keys: str) -> Iterator[None]:
    """Unset environment variables for the block and restore them after."""
    previous = {k: os.environ.pop(k, None) for k in keys}
    try:
        yield
    finally:
        _restore(previous)


def _restore(previous: dict[str, str | None]) -> None:
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextmanager
def workflow_prefect(config: devstack.StackConfig) -> Iterator[None]:
    """Prefect's client settings of the workflow role for the block (its API and auth string;
    Prefect reads the environment once, so setting variables later is not enough)."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    auth = config.client_env(StackRole.WORKFLOW)["PREFECT_API_AUTH_STRING"]
    with temporary_settings(
        {PREFECT_API_URL: config.prefect_api_url, PREFECT_API_AUTH_STRING: auth}
    ):
        yield


# --- a user's shell as one role ---------------------------------------------------------


def _exports(config: devstack.StackConfig, role: StackRole, base: dict[str, str]) -> dict[str, str]:
    """What ``dpmerge stack env --role ROLE`` prints, as a shell's ``eval`` would set it."""
    printed = subprocess.run(
        [str(BIN / "dpmerge"), "stack", "env", "--role", role.value],
        env={**base, "DPMERGE_STACK_DIR": str(config.state_dir)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    found = {}
    for line in printed.stdout.splitlines():
        verb, *words = shlex.split(line)
        if verb == "unset":  # other roles' variables: this shell never had them
            assert all(name not in base for name in words), line
            continue
        assert verb == "export" and len(words) == 1, line
        key, value = words[0].split("=", 1)
        found[key] = value
    return found


@dataclass(frozen=True)
class Shell:
    """A shell whose environment is one role's exports and nothing else of this process:
    its own ``HOME`` and working directory, no stack directory to adopt, telemetry off."""

    role: StackRole
    env: dict[str, str]
    cwd: Path

    @classmethod
    def of(cls, config: devstack.StackConfig, role: StackRole, home: Path) -> Shell:
        home.mkdir(parents=True, exist_ok=True)
        base = {
            "PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(home),
            "LANG": "C.UTF-8",
            "TMPDIR": os.environ.get("TMPDIR", "/tmp"),
            "DPMERGE_STACK_DIR": str(home / "no-stack"),
            "DPMERGE_HOME": str(home / "dpmerge"),
            "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            # this checkout's code, where an editable install names another (a git worktree)
            **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"},
        }
        return cls(role, {**base, **_exports(config, role, base)}, home)

    def run(
        self, *argv: str, timeout: float = 600, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` (a command of the virtual environment's ``bin/`` or on ``PATH``)."""
        return subprocess.run(
            list(argv),
            env={**self.env, **(env or {})},
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def dpmerge(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return self.run(str(BIN / "dpmerge"), *args, timeout=timeout)

    def python(self, code: str, *args: str, timeout: float = 600) -> Any:
        """Run ``code`` in this shell's Python; what it prints last, read as JSON."""
        done = self.run(str(BIN / "python"), "-c", code, *args, timeout=timeout)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The single line a refused command printed on stderr (no traceback, nothing else)."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return lines[0]


# --- the policy stack ------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A registered candidate version, as the workflow sees it."""

    name: str  # the record's name
    model: str  # the candidates' registered model
    version: str
    run_id: str
    epsilon: float


@dataclass(frozen=True)
class PolicyStack:
    """A deployed stack with digits candidates (their ε ascending) registered by the
    workflow; this process holds the workflow role's environment and key."""

    config: devstack.StackConfig
    candidates: tuple[Candidate, ...]

    @property
    def epsilons(self) -> list[float]:
        return [c.epsilon for c in self.candidates]

    @property
    def candidates_model(self) -> str:
        return self.candidates[0].model

    @property
    def releases_model(self) -> str:
        return self.candidates_model.removesuffix("-candidates") + "-releases"

    def shell(self, role: StackRole, home: Path) -> Shell:
        return Shell.of(self.config, role, home)


def prefect_client(config: devstack.StackConfig) -> Any:
    """A sync Prefect client with the workflow's auth string."""
    from prefect.client.orchestration import SyncPrefectClient

    auth = config.client_env()["PREFECT_API_AUTH_STRING"]
    return SyncPrefectClient(config.prefect_api_url, auth_string=auth)


def wait_run(config: devstack.StackConfig, run_id: Any, timeout_s: float = RUN_TIMEOUT_S) -> Any:
    """Flow run ``run_id`` once it is final (an assertion error after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    with prefect_client(config) as client:
        while time.monotonic() < deadline:
            run = client.read_flow_run(run_id)
            if run.state is not None and run.state.is_final():
                return run
            time.sleep(1)
    raise AssertionError(f"flow run {run_id} not finished after {timeout_s:.0f} s")


def train_candidates(config: devstack.StackConfig, sigmas: Sequence[float]) -> list[Candidate]:
    """Digits candidates (3 epochs, batch 64) trained and registered by one run of the
    ``train-candidates`` deployment on the ``cpu`` pool (in the run's process: no fan-out, no
    frontier report), as the workflow; their versions, ε ascending."""
    from mlflow import MlflowClient

    with prefect_client(config) as client:
        deployment = client.read_deployment_by_name("train-candidates/train-candidates")
        created = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={
                "dataset": "digits",
                "noise_multipliers": list(sigmas),
                "epochs": 3,
                "batch_size": 64,
                "learning_rate": 1.0,
                "deployment": None,
                "frontier_report": False,
            },
        )
    finished = wait_run(config, created.id)
    assert finished.state.is_completed(), finished.state.message
    mlflow = MlflowClient(config.mlflow_url)
    found = mlflow.search_model_versions("tags.`dp.role` = 'candidate'")
    assert len(found) == len(sigmas) and {v.tags["dp.status"] for v in found} == {"ready"}
    candidates = [
        Candidate(
            v.tags["dp.candidate"], v.name, str(v.version), v.run_id, float(v.tags["dp.epsilon"])
        )
        for v in found
    ]
    return sorted(candidates, key=lambda c: c.epsilon)


@contextmanager
def policy_stack(factory: pytest.TempPathFactory) -> Iterator[PolicyStack]:
    """The stack with deployments/prefect.yaml applied and three digits candidates; afterwards
    no process of it may still run."""
    from deployed import deployed_stack

    with deployed_stack(factory) as config:
        pids = [s.pid for s in devstack.status(config) if s.pid]
        yield PolicyStack(config, tuple(train_candidates(config, DIGITS_SIGMAS)))
    assert len(pids) == 7  # S3, PostgreSQL, MLflow, Prefect, the dispatcher, two workers
    for pid in pids:
        assert devstack.group_members(pid) == [], f"process group {pid} still running"
