"""The processes of the local stack, in start order, and how to tell each one is healthy.

Stage 0 is S3 (SeaweedFS ``weed mini``: master, volume, filer and S3 gateway in one process,
objects on disk under ``STATE/s3``, the identities of ``STATE/secrets/s3.json``) and PostgreSQL
(``STATE/postgres``; none with ``--database sqlite``); stage 1 the MLflow server (its auth app,
backend store and auth database in PostgreSQL, artifacts proxied to
``s3://<bucket>/mlartifacts``) and the Prefect server (PostgreSQL, an auth string), which need
nothing of each other; stage 2 one Prefect worker per work pool and the policy dispatcher
(``flows/dispatch.py``: stored policy versions become flow runs), with the workflow role's
environment. ``down`` stops the stages in reverse.

Healthy means answering *as itself*: every port of the service is listened on only by the
process supervisord started or its descendants (:func:`devstack.processes.owns_ports`), and the
service answers its health check; a worker's last heartbeat came after its process started; the
dispatcher's heartbeat came after its process started and is at most
:data:`DISPATCH_HEARTBEAT_PERIOD_S` old (alive means dispatching, not merely running).
``up``'s timeout and ``stack status`` say why a service is not healthy
(:meth:`Service.unhealthy_because`: its process, its ports, then :attr:`Service.problem`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from devstack import credentials as secrets_store
from devstack import postgres
from devstack.config import LOOPBACK, StackConfig, StackError, repo_root
from devstack.credentials import Credentials
from devstack.processes import alive, owns_ports, ports_problem, started_at
from devstack.roles import prefect_headers, role_env
from devstack.worker_user import heartbeat_file, supervised_user, worker_dir, worker_key_file
from dpmerge.environment import probe
from dpmerge.keys import KEY_ENV, KEY_FILE_ENV
from dpmerge.storage import MLFLOW_ARTIFACTS_PREFIX
from dpmerge.vocabulary import StackDatabase, StackRole

HEALTH_TIMEOUT_S = 5.0
"""How long one health probe waits for an answer (a loaded 2-core machine answers slowly)."""
DISPATCH_HEARTBEAT_PERIOD_S = 30.0
"""The dispatcher touches its heartbeat after every poll that reached the store and Prefect
(every 0.5 s when idle, a poll dispatching a burst takes seconds): one older than this means it
is stuck or failing every poll."""


@dataclass(frozen=True)
class Service:
    """One supervised program: its command, environment, ports and health check (given the
    supervised pid; :meth:`healthy` adds that the service owns its ports)."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    health: Callable[[int], bool]
    stage: int
    ports: tuple[int, ...] = ()
    url: str | None = None
    start_timeout_s: float = 300.0  # MLflow and Prefect migrate their databases at first start
    stop_timeout_s: float = 15.0
    stop_signal: str = "TERM"
    cwd: Path | None = None
    problem: Callable[[int], str | None] | None = None
    """Why the service is unhealthy, given its pid (``None``: healthy), where it can say."""
    user: str | None = None
    """The user supervisord runs it as (``None``: supervisord's own; devstack/worker_user.py)."""
    confined: bool = False
    """Meant to run as the worker user: ``status`` reports it when it runs as the admin."""

    def healthy(self, pid: int | None) -> bool:
        return pid is not None and owns_ports(pid, self.ports) and self.health(pid)

    def unhealthy_because(self, pid: int | None) -> str:
        """Why :meth:`healthy` is false for ``pid``, as far as the service can say."""
        if pid is None or not alive(pid):
            return "its process is not running"
        held = ports_problem(pid, self.ports)
        if held is not None:
            return held
        said = self.problem(pid) if self.problem is not None else None
        return said or "it does not pass its health check"


def executable(name: str) -> str:
    """``name`` next to this interpreter (the project's virtualenv), else on ``PATH``."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.is_file() else shutil.which(name)
    if found is None:
        raise StackError(f"{name!r} not found next to {sys.executable} or on PATH")
    return found


def worker_name(pool: str) -> str:
    return f"dpmerge-{pool}"


def worker_service(pool: str) -> str:
    """The supervised program of ``pool``'s worker."""
    return f"worker-{pool}"


def worker_online(config: StackConfig, creds: Credentials, pool: str, pid: int) -> bool:
    """The pool's worker is ``ONLINE`` and its last heartbeat came after process ``pid``
    started (an earlier worker of the same name stays ``ONLINE`` for a while after it died)."""
    url = f"{config.prefect_api_url}/work_pools/{pool}/workers/filter"
    answer = probe(
        url, method="POST", body={}, headers=prefect_headers(creds), timeout_s=HEALTH_TIMEOUT_S
    )
    started = started_at(pid)
    if started is None or not isinstance(answer.body, list):
        return False
    for worker in answer.body:
        if (
            isinstance(worker, dict)
            and worker.get("name") == worker_name(pool)
            and worker.get("status") == "ONLINE"
        ):
            try:
                beat = datetime.fromisoformat(str(worker.get("last_heartbeat_time")))
            except ValueError:
                return False
            return beat.timestamp() >= started
    return False


def heartbeat_problem(
    heartbeat: Path,
    pid: int,
    period_s: float = DISPATCH_HEARTBEAT_PERIOD_S,
    now: float | None = None,
) -> str | None:
    """Why the dispatcher (process ``pid``) is not alive, or ``None``: it touched ``heartbeat``
    after it started (it reached the state store and the Prefect API) and at most ``period_s``
    before ``now`` (default: the time now)."""
    started = started_at(pid)
    if started is None:
        return f"process {pid} is gone"
    try:
        beat = heartbeat.stat().st_mtime
    except OSError:
        return f"no heartbeat yet ({heartbeat})"
    if beat < started:
        return "no heartbeat since its process started (not reaching S3 or Prefect; see its log)"
    age = (time.time() if now is None else now) - beat
    if age > period_s:
        return (
            f"its last heartbeat is {age:.0f} s old (more than {period_s:g} s): it is not "
            "dispatching (stuck, or every poll fails; see its log)"
        )
    return None


def store_problem(config: StackConfig) -> str | None:
    """Why S3 is not ready (``None``: ready): it answers, and SeaweedFS's master knows every
    volume its volume server loaded from disk. ``/healthz`` alone is not enough: until the
    volume server's first heartbeat reaches the master, reads fail with InternalError ("volume
    not found"; seen for 5 s after a restart)."""
    health = probe(f"{config.s3_url}/healthz", timeout_s=HEALTH_TIMEOUT_S)
    if not health.ok:
        return f"its S3 gateway does not answer /healthz ({health.error or health.status})"
    ports = config.store_flags
    loaded = probe(f"http://{LOOPBACK}:{ports['volume.port']}/status", timeout_s=HEALTH_TIMEOUT_S)
    topology = probe(
        f"http://{LOOPBACK}:{ports['master.port']}/dir/status", timeout_s=HEALTH_TIMEOUT_S
    )
    try:
        nodes = [
            node
            for centre in topology.body["Topology"]["DataCenters"] or []
            for rack in centre["Racks"] or []
            for node in rack["DataNodes"] or []
        ]
        volumes = loaded.body["Volumes"] or []
        known = sum(n["Volumes"] for n in nodes)
    except (TypeError, KeyError):
        return (
            f"its master's topology ({topology.error or topology.status}) or volume server's "
            f"status ({loaded.error or loaded.status}) is not readable"
        )
    if not nodes:
        return "its master knows no volume server yet (no heartbeat)"
    if known < len(volumes):
        return f"its master knows {known} of the {len(volumes)} volumes loaded from disk"
    return None


def s3_config_file(config: StackConfig) -> Path:
    return secrets_store.secrets_dir(config.state_dir) / "s3.json"


def mlflow_auth_file(config: StackConfig) -> Path:
    return secrets_store.secrets_dir(config.state_dir) / "mlflow-auth.ini"


def backend_store_uri(config: StackConfig, creds: Credentials) -> str:
    if config.database is StackDatabase.POSTGRES:
        return postgres.url(config, "mlflow", creds.database["mlflow"], "mlflow", "psycopg")
    return f"sqlite:///{config.mlflow_dir / 'mlflow.db'}"


def _database(config: StackConfig, creds: Credentials) -> list[Service]:
    if config.database is not StackDatabase.POSTGRES:
        return []
    return [
        Service(
            name="postgres",
            argv=tuple(postgres.server_argv(config)),
            env={},
            health=lambda _pid: postgres.ready(config, creds),
            stage=0,
            ports=(config.postgres_port,),
            start_timeout_s=60.0,
            stop_signal="INT",  # fast shutdown: roll back open transactions, then exit
        )
    ]


def services(config: StackConfig) -> list[Service]:
    """Every service of ``config`` in start order (the stack's credentials must exist)."""
    creds = secrets_store.require(config.state_dir)
    mlflow_key = creds.s3["mlflow"]
    store_flags = [f"-{name}={port}" for name, port in config.store_flags.items()]
    result = [
        Service(
            name="s3",
            argv=(
                executable("weed"),
                "mini",
                f"-dir={config.s3_dir}",
                f"-ip={LOOPBACK}",
                f"-ip.bind={LOOPBACK}",
                f"-s3.port={config.s3_port}",
                *store_flags,
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-webdav=false",
                "-admin.ui=false",
                "-master.telemetry=false",
                f"-s3.config={s3_config_file(config)}",
                f"-s3.localSocket={config.state_dir / 's3.sock'}",
            ),
            # the identities are those of -s3.config only: none from the environment
            env={"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""},
            health=lambda _pid: store_problem(config) is None,
            problem=lambda _pid: store_problem(config),
            stage=0,
            ports=(config.s3_port, *config.store_flags.values()),
            url=config.s3_url,
            start_timeout_s=120.0,  # ready in 1–5 s even at 16 runnable processes per core
        ),
        *_database(config, creds),
        Service(
            name="mlflow",
            argv=(
                executable("mlflow"),
                "server",
                *("--app-name", "basic-auth"),
                *("--artifacts-destination", f"s3://{config.bucket}/{MLFLOW_ARTIFACTS_PREFIX}"),
                *("--host", LOOPBACK, "--port", str(config.mlflow_port), "--workers", "1"),
            ),
            env={
                "MLFLOW_BACKEND_STORE_URI": backend_store_uri(config, creds),
                "MLFLOW_AUTH_CONFIG_PATH": str(mlflow_auth_file(config)),
                "MLFLOW_AUTH_ADMIN_PASSWORD": creds.mlflow_admin,
                "MLFLOW_FLASK_SERVER_SECRET_KEY": creds.mlflow_session,
                "AWS_ACCESS_KEY_ID": mlflow_key.access_key_id,
                "AWS_SECRET_ACCESS_KEY": mlflow_key.secret_access_key,
                "AWS_DEFAULT_REGION": "us-east-1",
                "MLFLOW_S3_ENDPOINT_URL": config.s3_url,
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            },
            health=lambda _pid: probe(f"{config.mlflow_url}/health", timeout_s=HEALTH_TIMEOUT_S).ok,
            stage=1,
            ports=(config.mlflow_port,),
            url=config.mlflow_url,
        ),
    ]
    if not config.prefect:
        return result
    # the workflow's processes read the key from its file (role_env), and none of the stack's
    # from the environment of the shell that ran `up`
    prefect_env = {"PREFECT_HOME": str(config.prefect_home), KEY_ENV: ""}
    database = {}
    if config.database is StackDatabase.POSTGRES:
        database["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = postgres.url(
            config, "prefect", creds.database["prefect"], "prefect", "asyncpg"
        )
    result.append(
        Service(
            name="prefect",
            argv=(
                executable("prefect"),
                *("server", "start", "--host", LOOPBACK, "--port", str(config.prefect_port)),
            ),
            env={
                **prefect_env,
                **database,
                "PREFECT_API_URL": config.prefect_api_url,
                "PREFECT_API_AUTH_STRING": creds.prefect_auth,
                "PREFECT_SERVER_API_AUTH_STRING": creds.prefect_auth,
                "PREFECT_SERVER_API_HOST": LOOPBACK,
                "PREFECT_SERVER_API_PORT": str(config.prefect_port),
            },
            health=lambda _pid: (
                probe(f"{config.prefect_api_url}/health", timeout_s=HEALTH_TIMEOUT_S).body is True
            ),
            stage=1,
            ports=(config.prefect_port,),
            url=config.prefect_api_url,
            stop_timeout_s=30.0,
        )
    )
    # the workers and the dispatcher: the workflow's credentials only, as the worker user, at
    # home in its own directory (devstack/worker_user.py)
    user, home = supervised_user(config), worker_dir(config)
    workflow_env = {
        **role_env(config, StackRole.WORKFLOW),
        **prefect_env,
        KEY_FILE_ENV: str(worker_key_file(config)),
        "HOME": str(home),
        "PREFECT_HOME": str(home / "prefect"),
        "DPMERGE_HOME": str(home / "dpmerge"),
    }
    result.append(
        Service(
            name="dispatcher",
            argv=(
                *(sys.executable, "-m", "flows.dispatch"),
                *("--heartbeat", str(heartbeat_file(config))),
            ),
            env=workflow_env,
            health=lambda pid: heartbeat_problem(heartbeat_file(config), pid) is None,
            problem=lambda pid: heartbeat_problem(heartbeat_file(config), pid),
            stage=2,
            cwd=repo_root(),
            user=user,
            confined=True,
        )
    )
    for pool in config.pools:
        worker_env = {
            **workflow_env,
            "PREFECT_WORKER_QUERY_SECONDS": str(config.worker_query_seconds),
            # the pools' commands run the first ``python`` on PATH: this environment's
            "PATH": os.pathsep.join(
                [str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)]
            ),
        }
        if pool == "cpu":
            worker_env["CUDA_VISIBLE_DEVICES"] = ""
        result.append(
            Service(
                name=worker_service(pool),
                argv=(
                    executable("prefect"),
                    *("worker", "start", "--pool", pool, "--type", "process"),
                    *("--name", worker_name(pool)),
                ),
                env=worker_env,
                health=lambda pid, pool=pool: worker_online(config, creds, pool, pid),
                stage=2,
                # A worker under load can need more than 20 s to stop after SIGTERM.
                stop_timeout_s=90.0,
                cwd=repo_root(),
                user=user,
                confined=True,
            )
        )
    return result
