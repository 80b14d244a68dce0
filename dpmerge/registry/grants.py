"""READ for the configured readers on what the registry creates, through the MLflow auth app's
own permission API (docs/design.md#registry; who reads what: :mod:`~dpmerge.registry.readers`).

The creator of an experiment or registered model gets MANAGE from the auth app, and a MANAGE
holder may grant permissions on it (a READ holder may not: the server answers 403), so the
workflow grants right after it creates one. A server without the auth app has no such API; it
is never called there, because the readers are configured only for a stack with auth.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlflow.utils.credentials import get_default_host_creds
from mlflow.utils.rest_utils import http_request, verify_rest_response

GRANT_ENDPOINT = "/api/3.0/mlflow/users/permissions/grant"
EXPERIMENT, REGISTERED_MODEL = "experiment", "registered_model"


def grant_read(
    tracking_uri: str, resource_type: str, resource_id: str, users: Sequence[str]
) -> None:
    """Give each of ``users`` READ on one experiment (by id) or registered model (by name);
    MLflow's errors propagate (the caller turns them into :class:`RegistryError`)."""
    if not users or not tracking_uri.startswith(("http://", "https://")):
        return
    credentials = get_default_host_creds(tracking_uri)
    for user in users:
        body = {
            "username": user,
            "resource_type": resource_type,
            "resource_id": resource_id,
            "permission": "READ",
        }
        response = http_request(credentials, GRANT_ENDPOINT, "POST", json=body)
        verify_rest_response(response, GRANT_ENDPOINT)
