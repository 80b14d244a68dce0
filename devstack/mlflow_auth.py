"""The MLflow server's ``authorization_function`` (its auth app's configuration,
docs/stack.md#roles-and-permissions): MLflow's own basic authentication, then one rule the auth
app has no permission for — only the workflow and the admin create.

MLflow lets every signed-in user create an experiment, a registered model or another top-level
object, and makes the creator its manager. On this stack that let a consumer or an operator
take a name the workflow needs (``dpmerge-studies``, a dataset's ``…-releases`` model) and put a
look-alike model under a policy's alias. Creation is a request whose last path segment is
``create`` or ``register`` (the REST and the UI's ``ajax-api`` routes alike); every other
request is decided by MLflow as before, and the workflow's and admin's requests are untouched.
This module runs inside the MLflow server process.
"""

from __future__ import annotations

from flask import Response, request
from mlflow.server.auth import authenticate_request_basic_auth

from devstack.credentials import MLFLOW_ADMIN
from dpmerge.vocabulary import StackRole

CREATORS = frozenset({StackRole.WORKFLOW.value, MLFLOW_ADMIN})
CREATING_SEGMENTS = frozenset({"create", "register"})
REFUSAL = "Permission denied: on this stack only the workflow creates MLflow objects"


def creates(path: str) -> bool:
    """Whether a request to ``path`` (any method but a read) creates a top-level object."""
    return path.rstrip("/").rsplit("/", 1)[-1] in CREATING_SEGMENTS


def authenticate_request() -> object:
    """MLflow's basic authentication; a creating request of any other user is refused (403)."""
    result = authenticate_request_basic_auth()
    if isinstance(result, Response) or request.method in ("GET", "HEAD", "OPTIONS"):
        return result
    if result.username not in CREATORS and creates(request.path):
        return Response(REFUSAL, status=403, mimetype="text/plain")
    return result
