"""What ``up`` creates inside the running services, through their own APIs
(docs/stack.md#roles-and-permissions): the MLflow users, the Prefect work pools with job
templates a caller cannot override, and no Secret block with the workflow key (an earlier
version's is deleted); and the check that the pools still have those templates
(:func:`pool_drift`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from devstack import credentials as secrets_store
from devstack.config import StackConfig, StackError
from devstack.credentials import Credentials
from devstack.roles import auth_headers, basic_auth, prefect_headers
from dpmerge.environment import QUIET, Probe, probe
from dpmerge.findings import Finding
from dpmerge.vocabulary import FindingKind, StackRole

API_TIMEOUT_S = 30.0


def create_mlflow_users(config: StackConfig, creds: Credentials) -> None:
    """One MLflow user per role, created by the auth app's admin (an existing user gets its
    password set again, so the state directory's secrets stay the truth)."""
    admin = basic_auth(secrets_store.MLFLOW_ADMIN, creds.mlflow_admin)

    def call(path: str, method: str, body: dict[str, str]) -> Any:
        url = f"{config.mlflow_url}/api/2.0/mlflow/users/{path}"
        return probe(url, method=method, body=body, headers=admin, timeout_s=API_TIMEOUT_S)

    for role in StackRole:
        body = {"username": role.value, "password": creds.mlflow_users[role.value]}
        answer = call("create", "POST", body)
        if not answer.ok and _error_code(answer.body) == "RESOURCE_ALREADY_EXISTS":
            answer = call("update-password", "PATCH", body)
        if not answer.ok:
            raise StackError(
                f"creating the MLflow user {role.value!r} failed: {answer.error} {answer.body}"
            )


def _error_code(body: Any) -> str | None:
    return body.get("error_code") if isinstance(body, dict) else None


WARM_COMMAND = "python -m flows.warm"
ENGINE_COMMAND = "python -m prefect.engine"


def pool_command(pool: str) -> str:
    """The one command a pool's flow runs start with: the ``cpu`` pool's runs start from the
    warm process (flows/warm.py), the others' from a fresh engine. ``python`` is the first one
    on the worker's ``PATH``: the worker host's own environment, where dpmerge is installed
    (docs/workflow.md#worker-hosts), never a path into the operator's checkout."""
    return WARM_COMMAND if pool == "cpu" else ENGINE_COMMAND


def locked_template(pool: str) -> dict[str, Any]:
    """A ``process`` pool's base job template with no variable at all: command, environment,
    working directory and labels are fixed here, and the schema admits no job variable, so
    neither a deployment nor a flow run can change what a worker executes."""
    return {
        "job_configuration": {
            "command": pool_command(pool),
            "env": dict(QUIET),
            "labels": {},
            "name": None,
            "stream_output": True,
            "working_dir": None,
        },
        "variables": {"type": "object", "properties": {}, "additionalProperties": False},
    }


def _save_pool(api_url: str, auth: str, pool: str) -> Probe:
    """Create ``pool`` with :func:`locked_template`, or set an existing pool's template back."""
    headers = auth_headers(auth)
    template = locked_template(pool)
    answer = probe(
        f"{api_url}/work_pools/",
        method="POST",
        body={"name": pool, "type": "process", "base_job_template": template},
        headers=headers,
        timeout_s=API_TIMEOUT_S,
    )
    if answer.status == 409:
        answer = probe(
            f"{api_url}/work_pools/{pool}",
            method="PATCH",
            body={"base_job_template": template},
            headers=headers,
            timeout_s=API_TIMEOUT_S,
        )
    return answer


def ensure_pools(config: StackConfig, creds: Credentials) -> None:
    """Create the ``process`` pools, or set their template back to :func:`locked_template`."""
    for pool in config.pools:
        answer = _save_pool(config.prefect_api_url, creds.prefect_auth, pool)
        if not answer.ok:
            raise StackError(f"creating work pool {pool!r} failed: {answer.error} {answer.body}")


class PoolReadError(StackError):
    """The Prefect API did not answer with a work pool (down, overloaded: 503, or refusing)."""


def pool_drift(api_url: str, auth: str, pools: Sequence[str], *, repair: bool) -> list[Finding]:
    """A ``pool_template_drift`` finding for each of ``pools`` whose base job template is not
    :func:`locked_template` or that is gone (whoever holds the Prefect credential can change
    it: docs/stack.md#roles-and-permissions); with ``repair``, its template is set back (the
    pool created again). Raises :class:`PoolReadError` when the Prefect API does not answer
    with the pool."""
    found = []
    for pool in pools:
        answer = probe(
            f"{api_url}/work_pools/{pool}", headers=auth_headers(auth), timeout_s=API_TIMEOUT_S
        )
        if answer.status == 404:
            detail = "the pool is gone"
        elif not answer.ok or not isinstance(answer.body, dict):
            raise PoolReadError(f"reading work pool {pool!r} failed: {answer.error} {answer.body}")
        elif answer.body.get("base_job_template") != locked_template(pool):
            command = (answer.body.get("base_job_template") or {}).get("job_configuration", {})
            detail = (
                "its base job template is not the provisioned one (command "
                f"{command.get('command')!r}, provisioned {pool_command(pool)!r})"
            )
        else:
            continue
        repaired = None
        if repair:
            saved = _save_pool(api_url, auth, pool)
            repaired = "template set back" if saved.ok else f"not repaired ({saved.error})"
        subject = f"work pool {pool}"
        found.append(Finding(FindingKind.POOL_TEMPLATE_DRIFT, subject, detail, repaired))
    return found


OLD_SECRET_BLOCK = "dpmerge-key"
"""The Prefect Secret block an earlier version saved the workflow key in."""


def remove_secret_block(config: StackConfig, creds: Credentials) -> None:
    """Delete the Secret block :data:`OLD_SECRET_BLOCK` if a stack made by an earlier version
    has it: anyone holding the Prefect credential could read the key from it; the workflow's
    processes read ``STATE/secrets/workflow.key`` (docs/stack.md#trust-model)."""
    headers = prefect_headers(creds)
    api = config.prefect_api_url
    found = probe(
        f"{api}/block_types/slug/secret/block_documents/name/{OLD_SECRET_BLOCK}",
        headers=headers,
        timeout_s=API_TIMEOUT_S,
    )
    if found.status == 404:
        return
    answer = found
    if found.ok and isinstance(found.body, dict):
        answer = probe(
            f"{api}/block_documents/{found.body.get('id')}",
            method="DELETE",
            headers=headers,
            timeout_s=API_TIMEOUT_S,
        )
    if not answer.ok:
        raise StackError(
            f"removing the Secret block {OLD_SECRET_BLOCK!r} failed: {answer.error} {answer.body}"
        )
