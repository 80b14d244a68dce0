"""The MLflow server's ``authorization_function`` (its auth app's configuration,
docs/stack.md#roles-and-permissions): MLflow's own basic authentication, then the stack's
allow-list of writes (:mod:`devstack.mlflow_writes`).

MLflow lets every signed-in user create an experiment, a registered model or another top-level
object (its UI's demo generator included) and makes the creator its manager; on this stack that
let a consumer or an operator take a name the workflow needs or put a look-alike model under a
policy's alias. So a request that is not a read is answered only if the signed-in user's role
may make it; any other gets 403 and one line naming the route and the role. Reads, and
everything an allowed request then needs, are decided by MLflow as before. MLflow calls this
for every request its Flask app serves and, through its bridge, for the routes its FastAPI app
serves itself; there ``request.url_rule`` is the Flask route the path matches, if any.
This module runs inside the MLflow server process.
"""

from __future__ import annotations

from flask import Response, request
from mlflow.server.auth import authenticate_request_basic_auth

from devstack.mlflow_writes import allowed, refusal


def authenticate_request() -> object:
    """MLflow's basic authentication; a request not on the user's role's list is refused."""
    result = authenticate_request_basic_auth()
    if isinstance(result, Response):
        return result
    route = request.url_rule.rule if request.url_rule is not None else request.path
    if not allowed(result.username, request.method, route):
        text = refusal(result.username, request.method, request.path)
        return Response(text, status=403, mimetype="text/plain")
    return result
