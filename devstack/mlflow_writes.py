"""What each stack role may ask MLflow beyond a read: an allow-list, everything else refused
(docs/stack.md#roles-and-permissions, "MLflow writes: an allow-list").

A read (``GET``, ``HEAD``, ``OPTIONS``) is MLflow's to decide. Any other request is allowed only
if its ``(method, route)`` is on the list of the signed-in user's role; the admin is
unrestricted; a user with no role may make none. A route is MLflow's template
(``/api/2.0/mlflow/logged-models/<model_id>``), with the UI's ``/ajax-api/…`` form of a route
normalised to its ``/api/…`` form, so one entry covers both where MLflow serves both.

How the list was derived: the workflow's entries are the REST calls behind the ``MlflowClient``
methods the registry adapter makes (``dpmerge/registry/``: ``create_experiment``,
``create_run``, ``log_batch``, ``log_param``, ``log_inputs``, ``set_terminated``,
``create_logged_model``, ``finalize_logged_model``, ``log_artifact``/``log_text``/
``log_model_artifact`` through the artifact proxy, ``create_registered_model``,
``create_model_version``, the tag and alias setters and deleters) and the auth app's grant
(``dpmerge/registry/grants.py``); no flow, task or command calls MLflow but through it
(docs/design.md#registry). Every role gets the ``POST`` routes that only
read and that MLflow filters by the user's permissions (:data:`SEARCHES`): the clients' and the
UI's searches and the UI's GraphQL, whose only mutations are searches.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from devstack.credentials import MLFLOW_ADMIN
from dpmerge.vocabulary import StackRole

READS = frozenset({"GET", "HEAD", "OPTIONS"})
API, AJAX = "/api/", "/ajax-api/"
TRACKING, AUTH = "/api/2.0/mlflow", "/api/3.0/mlflow"

SEARCHES = frozenset(
    {
        ("POST", f"{TRACKING}/experiments/search"),
        ("POST", f"{TRACKING}/runs/search"),
        ("POST", f"{TRACKING}/logged-models/search"),
        ("POST", f"{TRACKING}/registered-models/get-latest-versions"),
        ("POST", "/graphql"),
    }
)
"""Requests that only read, made with ``POST``; MLflow answers each with what the user may read."""

WORKFLOW_WRITES = frozenset(
    {
        ("POST", f"{TRACKING}/experiments/create"),
        ("POST", f"{TRACKING}/runs/create"),
        ("POST", f"{TRACKING}/runs/update"),
        ("POST", f"{TRACKING}/runs/log-batch"),
        ("POST", f"{TRACKING}/runs/log-parameter"),
        ("POST", f"{TRACKING}/runs/log-inputs"),
        ("POST", f"{TRACKING}/logged-models"),
        ("PATCH", f"{TRACKING}/logged-models/<model_id>"),
        ("PATCH", f"{TRACKING}/logged-models/<model_id>/tags"),
        ("PUT", "/api/2.0/mlflow-artifacts/artifacts/<path:artifact_path>"),
        ("POST", f"{TRACKING}/registered-models/create"),
        ("POST", f"{TRACKING}/registered-models/set-tag"),
        ("DELETE", f"{TRACKING}/registered-models/delete-tag"),
        ("POST", f"{TRACKING}/registered-models/alias"),
        ("DELETE", f"{TRACKING}/registered-models/alias"),
        ("POST", f"{TRACKING}/model-versions/create"),
        ("POST", f"{TRACKING}/model-versions/set-tag"),
        ("POST", f"{AUTH}/users/permissions/grant"),
    }
)
"""What the workflow writes: its experiments, runs, logged models and their artifacts, its
registered models, versions, tags and aliases, and READ grants on what it created."""

ALLOWED: Mapping[str, frozenset[tuple[str, str]]] = MappingProxyType(
    {
        StackRole.WORKFLOW.value: SEARCHES | WORKFLOW_WRITES,
        StackRole.OPERATOR.value: SEARCHES,
        StackRole.CONSUMER.value: SEARCHES,
    }
)
"""Role (its MLflow user) -> the ``(method, route)`` pairs it may request besides reads."""


def route_of(path: str) -> str:
    """The route's key: the UI's ``/ajax-api/…`` form of a route is its ``/api/…`` form."""
    return API + path.removeprefix(AJAX) if path.startswith(AJAX) else path


def allowed(user: str, method: str, route: str) -> bool:
    """Whether ``user`` may make a ``method`` request of ``route`` (a route template, or the
    request's path where no route matched) as far as this stack is concerned."""
    if method in READS or user == MLFLOW_ADMIN:
        return True
    return (method, route_of(route)) in ALLOWED.get(user, frozenset())


def refusal(user: str, method: str, path: str) -> str:
    """The one line a refused request is answered with."""
    return (
        f"Permission denied: {method} {path} is not on the MLflow allow-list of the role "
        f"{user!r} on this stack (docs/stack.md#roles-and-permissions)"
    )
