"""The stack's roles and what each may do, through each service's own mechanism
(docs/stack.md#roles-and-permissions).

* S3 (SeaweedFS ``-s3.config``): ``admin`` (the stack itself: buckets, the store generation),
  ``mlflow`` (the MLflow server's artifact proxy: ``<bucket>/mlartifacts/*`` only), ``workflow``
  (the state and audit buckets) and ``operator`` (reads the state bucket, writes only its
  ``inbox/``: requests, which the workflow's dispatcher records into the canonical tree,
  dpmerge.state.inbox). A consumer has no S3 identity.
* MLflow (``--app-name basic-auth``, ``default_permission = NO_PERMISSIONS``): the users
  ``workflow``, ``operator``, ``consumer`` (created at ``up`` through the auth app's API by its
  admin). Each role writes only what its allow-list names (:mod:`devstack.mlflow_writes`,
  applied by :mod:`devstack.mlflow_auth`): only the workflow creates; what it creates it
  manages, and the registry grants READ as ``$DPMERGE_MLFLOW_READERS`` (:data:`MLFLOW_READERS`)
  says.
* Prefect (``PREFECT_SERVER_API_AUTH_STRING``): all or nothing, so only ``workflow`` holds it;
  the workflow key is not in Prefect (no Secret block): the workflow's processes read its file.

:func:`role_env` is one role's environment (``dpmerge stack env --role ROLE``): its own
credentials only.
"""

from __future__ import annotations

import base64
from typing import Any

from devstack import credentials as secrets_store
from devstack.config import StackConfig
from devstack.credentials import Credentials
from dpmerge.environment import TELEMETRY_OFF
from dpmerge.keys import KEY_FILE_ENV, WorkflowKey
from dpmerge.manifests import PUBLIC_KEY_ENV, public_key_hex
from dpmerge.model_signature import PUBLIC_KEY_ENV as MODEL_SIGNING_KEY_ENV
from dpmerge.model_signature import published_public_key
from dpmerge.registry.readers import READERS_ENV, format_readers
from dpmerge.storage import DEFAULT_REGION, MLFLOW_ARTIFACTS_PREFIX, S3Config
from dpmerge.vocabulary import StackDatabase, StackRole

LOCKED_POOLS_ENV = "DPMERGE_LOCKED_POOLS"
"""The pools the stack provisioned, comma-separated, in the workflow's environment: those
``verify-state`` checks against their provisioned templates (devstack/provision.py)."""
OPERATOR_WRITES = ("inbox",)

MLFLOW_READERS = {
    "dpmerge-candidates": [StackRole.OPERATOR.value],
    "dpmerge-releases": [StackRole.OPERATOR.value, StackRole.CONSUMER.value],
    "dpmerge-reports": [StackRole.OPERATOR.value],
    "dpmerge-studies": [StackRole.OPERATOR.value],
}
"""Experiment -> the users the registry grants READ when it creates it (and its registered
models); the creator (the workflow) manages them."""


def _s3_actions(config: StackConfig) -> dict[str, list[str]]:
    state, audit, project = config.state_bucket, config.audit_bucket, config.bucket

    def full(target: str) -> list[str]:
        return [f"{action}:{target}" for action in ("Read", "Write", "List", "Tagging")]

    artifacts = f"{project}/{MLFLOW_ARTIFACTS_PREFIX}/*"
    return {
        "admin": ["Admin", "Read", "Write", "List", "Tagging"],
        "mlflow": [f"Read:{artifacts}", f"Write:{artifacts}", f"List:{artifacts}"],
        StackRole.WORKFLOW.value: [*full(state), *full(audit)],
        StackRole.OPERATOR.value: [
            f"Read:{state}",
            f"List:{state}",
            *(f"Write:{state}/{prefix}/*" for prefix in OPERATOR_WRITES),
        ],
    }


def s3_identities(config: StackConfig, creds: Credentials) -> dict[str, Any]:
    """SeaweedFS's ``-s3.config`` document: one identity per S3 user, nothing anonymous."""
    actions = _s3_actions(config)
    return {
        "identities": [
            {
                "name": name,
                "credentials": [
                    {"accessKey": key.access_key_id, "secretKey": key.secret_access_key}
                ],
                "actions": actions[name],
            }
            for name, key in creds.s3.items()
        ]
    }


def s3_config_for(config: StackConfig, creds: Credentials, identity: str) -> S3Config:
    key = creds.s3[identity]
    return S3Config(
        endpoint_url=config.s3_url,
        bucket=config.bucket,
        audit_bucket=config.audit_bucket,
        state_bucket=config.state_bucket,
        access_key_id=key.access_key_id,
        secret_access_key=key.secret_access_key,
        block_public_access=False,
    )


def admin_s3_config(config: StackConfig) -> S3Config:
    return s3_config_for(config, secrets_store.require(config.state_dir), "admin")


def mlflow_auth_database(config: StackConfig, creds: Credentials) -> str:
    if config.database is StackDatabase.POSTGRES:
        from devstack.postgres import url

        return url(config, "mlflow", creds.database["mlflow"], "mlflow_auth", "psycopg")
    return f"sqlite:///{config.mlflow_dir / 'auth.db'}"


AUTH_CACHE_TTL_S = 60
"""How long MLflow's auth app keeps a successful credential check (its own cache, off by
default): each check is a deliberately slow password hash, about 1 s per request at load 7 on
the 2-core machine, which made every registry call of a flow or command wait on it. A changed
password or a deleted user is refused at the latest this long after the change."""


def mlflow_auth_ini(config: StackConfig, creds: Credentials) -> str:
    """The auth app's configuration (``MLFLOW_AUTH_CONFIG_PATH``); the admin's password comes
    from ``MLFLOW_AUTH_ADMIN_PASSWORD`` at its first start."""
    return "\n".join(
        [
            "[mlflow]",
            "default_permission = NO_PERMISSIONS",
            f"database_uri = {mlflow_auth_database(config, creds)}",
            f"admin_username = {secrets_store.MLFLOW_ADMIN}",
            "authorization_function = devstack.mlflow_auth:authenticate_request",
            "grant_default_workspace_access = false",
            f"auth_cache_ttl_seconds = {AUTH_CACHE_TTL_S}",
            "",
        ]
    )


def role_env(config: StackConfig, role: StackRole) -> dict[str, str]:
    """The environment of ``role``: MLflow with its own user and the releases' public
    signing key; S3 with its own key (workflow, operator); the key file's path (workflow: its
    processes and commands read the key from ``STATE/secrets/workflow.key``, never from
    Prefect); the Prefect API, its auth string and the provisioned pools (workflow)."""
    creds = secrets_store.require(config.state_dir)
    key = WorkflowKey(bytes.fromhex(secrets_store.workflow_key(config.state_dir)), "stack")
    env = {
        "MLFLOW_TRACKING_URI": config.mlflow_url,
        "MLFLOW_TRACKING_USERNAME": role.value,
        "MLFLOW_TRACKING_PASSWORD": creds.mlflow_users[role.value],
        # public: every role verifies a release's signature with it (dpmerge verify)
        PUBLIC_KEY_ENV: public_key_hex(key),
        # public: the PEM, base64, for `python -m model_signing verify key`
        MODEL_SIGNING_KEY_ENV: published_public_key(key),
        **TELEMETRY_OFF,
    }
    if role in (StackRole.WORKFLOW, StackRole.OPERATOR):
        key = creds.s3[role.value]
        env |= {
            "DPMERGE_S3_ENDPOINT_URL": config.s3_url,
            "DPMERGE_S3_BUCKET": config.bucket,
            "DPMERGE_S3_AUDIT_BUCKET": config.audit_bucket,
            "DPMERGE_S3_STATE_BUCKET": config.state_bucket,
            "AWS_ACCESS_KEY_ID": key.access_key_id,
            "AWS_SECRET_ACCESS_KEY": key.secret_access_key,
            "AWS_DEFAULT_REGION": DEFAULT_REGION,
        }
    if role is StackRole.WORKFLOW:
        env[READERS_ENV] = format_readers(MLFLOW_READERS)
        env[KEY_FILE_ENV] = str(secrets_store.workflow_key_file(config.state_dir))
        if config.prefect:
            env |= {
                "PREFECT_API_URL": config.prefect_api_url,
                "PREFECT_API_AUTH_STRING": creds.prefect_auth,
                LOCKED_POOLS_ENV: ",".join(config.pools),
            }
    return env


def basic_auth(user: str, password: str) -> dict[str, str]:
    """An HTTP Basic ``Authorization`` header."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def auth_headers(auth: str) -> dict[str, str]:
    """The header Prefect's API accepts: Basic with the auth string (``user:secret``)."""
    return basic_auth(*auth.split(":", 1))


def prefect_headers(creds: Credentials) -> dict[str, str]:
    """:func:`auth_headers` of the stack's Prefect auth string."""
    return auth_headers(creds.prefect_auth)
