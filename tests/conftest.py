"""Shared fixtures. Servers are real processes on loopback (see ``servers.py``), session-scoped,
started only when a test asks for them."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlite_template
from servers import (
    credentials_env,
    environment,
    running_stack,
    session_key,
)

import devstack.config
from devstack import StackConfig
from devstack.roles import LOCKED_POOLS_ENV
from dpmerge.environment import QUIET, TELEMETRY_OFF
from dpmerge.keys import KEY_FILE_ENV
from dpmerge.registry.readers import READERS_ENV
from dpmerge.storage import S3Store
from dpmerge.vocabulary import StackRole

for _key, _value in {**TELEMETRY_OFF, **QUIET}.items():
    os.environ.setdefault(_key, _value)
# the workflow's secret key (dpmerge.keys): one per test session, never a file in the repository;
# the key of every stack the session starts (its key file), so this process signs as they do
os.environ.setdefault("DPMERGE_SECRET_KEY", session_key())


SESSION_SERVERS = ("s3_mlflow_servers",)
"""The fixtures that start servers: under pytest-xdist every worker that runs a test needing
one starts its own, so the modules that share one run on one worker."""


SERVER_VARIABLES = ("AWS_", "DPMERGE_HOME", "DPMERGE_S3_", "MLFLOW_TRACKING_", "PREFECT_API_")
SERVER_VARIABLES_EXACT = (LOCKED_POOLS_ENV, READERS_ENV, KEY_FILE_ENV)


def _server_variables() -> dict[str, str]:
    return {
        key: value
        for key, value in os.environ.items()
        if key.startswith(SERVER_VARIABLES) or key in SERVER_VARIABLES_EXACT
    }


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_the_servers_variables() -> Iterator[None]:
    """A module (its tests and fixtures) leaves the variables that name servers, stores and
    credentials as it found them. A session fixture's environment once outlived its module, and
    the next module on that xdist worker talked to the wrong Prefect server — only when the
    scheduler put them together. This makes such a leak an error of the module that leaks,
    on every run."""
    before = _server_variables()
    yield
    after = _server_variables()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"the module left these variables changed: {', '.join(changed)}"


def pytest_configure(config: pytest.Config) -> None:
    """Register the group marker, so the suite also runs without pytest-xdist (``-p no:xdist``),
    and keep absl's log handler off pytest's capture file."""
    config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist runs on one worker")
    _absl_writes_to_the_real_stderr()
    sqlite_template.install()
    _ports_of_this_worker()


def _ports_of_this_worker() -> None:
    """Under pytest-xdist each worker picks its stacks' ports (``devstack.free_ports``) in its
    own slice of devstack's ranges. The stacks of several workers start at the same moment,
    and a port one picks is free until its service binds it: one ``up`` found its S3 port
    taken in that gap (who took it was not recorded; nothing else here binds in those ranges).
    ``tests/servers.py`` also starts such a stack once more on new ports."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    index, count = int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    for name in ("PICKED_PORTS", "ADMIN_PORTS"):
        low, high = getattr(devstack.config, name)
        width = (high - low) // count
        setattr(devstack.config, name, (low + index * width, low + (index + 1) * width))


def _absl_writes_to_the_real_stderr() -> None:
    """absl's handler (imported with dp_accounting) closes its stream on every
    ``logging.config.dictConfig`` — Prefect's and MLflow's imports call one — unless that stream
    is the *current* ``sys.stderr``. Imported during collection, its stream is pytest's capture
    file; a first ``import prefect`` inside a test that uses ``capsys`` then closed that file,
    and every later test of the worker failed on "I/O operation on closed file"."""
    from absl import logging as absl_logging

    absl_logging.get_absl_handler().python_handler.setStream(sys.__stderr__)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group tests for ``pytest -n N --dist loadgroup`` (scripts/test.sh): a module's tests stay
    on one worker (its module fixtures are built once), and the modules that use one session
    server form one group (the server starts once); other groups spread over the workers.
    It runs first: pytest-xdist names each test's group from these markers in its own hook."""
    modules: dict[str, set[str]] = {}
    for item in items:
        uses = modules.setdefault(item.nodeid.split("::")[0], set())
        uses.update(name for name in SESSION_SERVERS if name in item.fixturenames)
    group = {module: module for module in modules}

    def root(module: str) -> str:
        while group[module] != module:
            module = group[module]
        return module

    for server in SESSION_SERVERS:
        users = [module for module, uses in modules.items() if server in uses]
        for module in users[1:]:
            group[root(module)] = root(users[0])
    for item in items:
        item.add_marker(pytest.mark.xdist_group(root(item.nodeid.split("::")[0])))
    _longest_first(items, {module: root(module) for module in modules})


def _longest_first(items: list[pytest.Item], group: dict[str, str]) -> None:
    """Order the groups for scheduling (scripts/test.sh passes ``--no-loadscope-reorder``):
    those with an ``integration`` test (they start stacks and take minutes) first, then by size,
    each group's tests together in collection order — so no stack test is left for the end."""
    size: dict[str, int] = {}
    stack: set[str] = set()
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        name = group[item.nodeid.split("::")[0]]
        size[name] = size.get(name, 0) + 1
        first.setdefault(name, index)
        if item.get_closest_marker("integration"):
            stack.add(name)

    def key(item: pytest.Item) -> tuple[bool, int, int]:
        name = group[item.nodeid.split("::")[0]]
        return name not in stack, -size[name], first[name]

    items.sort(key=key)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Under ``--dist loadgroup`` every test id a worker collected must carry its group
    (pytest-xdist appends ``@group``); otherwise the groups are silently ignored and module
    fixtures (whole stacks) are rebuilt on several workers — stop before any test runs."""
    ungrouped = [nodeid for nodeid in ids if "@" not in nodeid]
    if ungrouped and node.config.getoption("dist") == "loadgroup":
        pytest.exit(
            f"pytest-xdist did not group {ungrouped[0]} (pytest {pytest.__version__}): "
            "install the versions pinned in pyproject.toml",
            returncode=4,
        )


@pytest.fixture(scope="session")
def s3_mlflow_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackConfig]:
    """S3, PostgreSQL and an MLflow server (its auth app, artifacts proxied to S3) on free
    loopback ports, started once per worker; see :func:`s3_mlflow` for a module's use."""
    with running_stack(tmp_path_factory.mktemp("s3-mlflow"), prefect=False) as config:
        yield config


@pytest.fixture(scope="module")
def s3_mlflow(s3_mlflow_servers: StackConfig) -> Iterator[StackConfig]:
    """The session's S3 and MLflow servers, with this process holding the workflow role's
    credentials (MLflow user, S3 key) for the module only."""
    with environment(credentials_env(s3_mlflow_servers, StackRole.WORKFLOW)):
        yield s3_mlflow_servers


@pytest.fixture(scope="module")
def mlflow_server(s3_mlflow: StackConfig) -> str:
    """Tracking URI of the session's MLflow server."""
    return s3_mlflow.mlflow_url


@pytest.fixture(scope="module")
def s3_store(s3_mlflow: StackConfig) -> S3Store:
    """A store on the session's S3 server as the stack's own identity (buckets already
    bootstrapped)."""
    return S3Store(s3_mlflow.s3_config())


@pytest.fixture(scope="module")
def local_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackConfig]:
    """The whole stack (S3, PostgreSQL, MLflow, Prefect, cpu/gpu pools and workers) on free
    ports, for one module, with this process's environment the workflow role's
    (PREFECT_API_URL and its auth string, MLFLOW_TRACKING_URI and its user, S3, the locked
    pools…) for that module only: a session-long environment once leaked into the next module
    on the same xdist worker, whose own Prefect test server then lacked the stack's pools
    (``verify-state`` reported them gone). Module-scoped because one module uses it: started
    once per session, it idled for the rest of its worker's session after that module (eight
    minutes at 0.2 of a core, its workers polling Prefect)."""
    with (
        running_stack(tmp_path_factory.mktemp("stack"), prefect=True) as config,
        environment(config.client_env()),
    ):
        yield config


@pytest.fixture
def mlflow_embedded(tmp_path: Path) -> str:
    """An embedded MLflow: a sqlite file in ``tmp_path`` (artifacts beside it)."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"
