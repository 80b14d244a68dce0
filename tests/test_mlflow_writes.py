"""The MLflow allow-list (devstack/mlflow_writes.py, docs/stack.md#roles-and-permissions) over
every route the stack's MLflow server registers: each role may make exactly the writes on its
list, every other route that is not a read (a new MLflow route included) is refused."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from devstack.credentials import MLFLOW_ADMIN
from devstack.mlflow_writes import ALLOWED, READS, SEARCHES, allowed, route_of
from dpmerge.vocabulary import StackRole

ROUTES = r"""
import json, re
from mlflow.server.auth import create_app
from mlflow.server import app as flask_app

app = create_app()

def native(routes, prefix=""):
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from native(included.routes, prefix + route.include_context.prefix)
        elif getattr(route, "methods", None):
            path = re.sub(r"\{(\w+):path\}", r"<path:\1>", prefix + route.path)
            yield from ((m, re.sub(r"\{(\w+)\}", r"<\1>", path)) for m in route.methods)

table = {(m, r.rule) for r in flask_app.url_map.iter_rules() for m in r.methods}
table |= set(native(app.routes))
print(json.dumps(sorted(table)))
"""


@pytest.fixture(scope="module")
def writes(tmp_path_factory: pytest.TempPathFactory) -> set[tuple[str, str]]:
    """Every (method, route) but reads that the stack's MLflow server (the auth app on
    uvicorn, as ``mlflow server --app-name basic-auth`` starts it) registers."""
    root = Path(tmp_path_factory.mktemp("mlflow-routes"))
    ini = root / "auth.ini"
    ini.write_text(
        f"[mlflow]\ndefault_permission = NO_PERMISSIONS\ndatabase_uri = sqlite:///{root}/auth.db\n"
        "admin_username = admin\nadmin_password = routes-only-password\n"
        "authorization_function = devstack.mlflow_auth:authenticate_request\n"
    )
    env = {
        "MLFLOW_AUTH_CONFIG_PATH": str(ini),
        "MLFLOW_FLASK_SERVER_SECRET_KEY": "routes-only-key",
        "_MLFLOW_SGI_NAME": "uvicorn",
    }
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", ROUTES],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    table = {(m, r) for m, r in json.loads(done.stdout.splitlines()[-1]) if m not in READS}
    assert len(table) > 250  # MLflow 3.17 registers about 320; an empty table tests nothing
    return table


def _allowed(user: str, table: set[tuple[str, str]]) -> set[tuple[str, str]]:
    return {(method, route_of(route)) for method, route in table if allowed(user, method, route)}


def test_each_role_may_write_exactly_its_list(writes: set[tuple[str, str]]) -> None:
    normalised = {(method, route_of(route)) for method, route in writes}
    for role in StackRole:
        assert ALLOWED[role.value] <= normalised, ALLOWED[role.value] - normalised  # no stale entry
        assert _allowed(role.value, writes) == ALLOWED[role.value], role
    assert _allowed(StackRole.CONSUMER.value, writes) == SEARCHES
    assert _allowed(StackRole.OPERATOR.value, writes) == SEARCHES
    workflow = {route for _, route in _allowed(StackRole.WORKFLOW.value, writes)}
    assert all(
        re.match(
            r"/api/2\.0/mlflow(-artifacts)?/|/api/3\.0/mlflow/users/permissions/grant$|/graphql$", r
        )
        for r in workflow
    ), workflow
    assert _allowed(MLFLOW_ADMIN, writes) == normalised
    assert _allowed("mallory", writes) == set()  # a user with no role writes nothing


def test_the_attack_runs_routes_are_refused(writes: set[tuple[str, str]]) -> None:
    """Row L: the UI's demo generator created an experiment for a consumer."""
    for route in ("/ajax-api/3.0/mlflow/demo/generate", "/ajax-api/3.0/mlflow/demo/delete"):
        assert ("POST", route) in writes
        for role in StackRole:
            assert not allowed(role.value, "POST", route)
    # the UI's form of a route is its REST form
    assert allowed(StackRole.WORKFLOW.value, "POST", "/ajax-api/2.0/mlflow/runs/create")
    assert not allowed(StackRole.CONSUMER.value, "POST", "/ajax-api/2.0/mlflow/runs/create")
    assert allowed(StackRole.CONSUMER.value, "GET", "/api/2.0/mlflow/anything")  # MLflow decides
