"""``up``, ``down`` and ``status`` of the local stack, on supervisord (docs/stack.md).

``up`` generates the stack's credentials on its first run (:mod:`devstack.credentials`), writes
``stack.json`` and the services' configuration files, starts supervisord and then the services
stage by stage (:mod:`devstack.services`), waiting for each stage to be healthy: S3 and
PostgreSQL, then the buckets, the database roles and the registry/store check
(:mod:`devstack.store`), then MLflow and the Prefect server, then the MLflow users and the locked
work pools (:mod:`devstack.provision`), then the workers.
``down`` stops the stages in reverse (workers first), then supervisord, then ends any process
of the stack still alive (an orphan of a service killed earlier). supervisord restarts a
service that crashes; its launcher first ends what the crashed one left behind. ``status``
also sets back a work pool whose base job template was changed, and reports its worker
unhealthy, the change its reason.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import asdict, dataclass, replace
from itertools import groupby
from pathlib import Path
from typing import Any

from devstack import credentials as secrets_store
from devstack import postgres, processes, provision, roles, worker_user
from devstack import store as registry_store
from devstack.config import (
    LOOPBACK,
    PortInUseError,
    ServiceStartError,
    StackConfig,
    StackError,
    port_free,
)
from devstack.services import (
    Service,
    mlflow_auth_file,
    s3_config_file,
    services,
    worker_service,
)
from devstack.supervisor import Supervisor, log_tail
from dpmerge.keys import KEY_ENV, KEY_FILE_ENV
from dpmerge.storage import S3Store
from dpmerge.vocabulary import StackDatabase, StackRole

POLL_S = 0.25
KILL_GRACE_S = 15.0  # after SIGKILL, how long a stopping process may take to be reaped


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    state: str  # supervisord's: RUNNING, STOPPED, BACKOFF, FATAL, …
    pid: int | None
    running: bool
    healthy: bool
    url: str | None
    log: Path
    orphans: tuple[int, ...] = ()  # live processes of an earlier instance of this service
    reason: str | None = None  # why it is unhealthy, where its service can say
    finding: str | None = None  # a finding that leaves it healthy (workers_not_separated)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "log": str(self.log)}


def _stages(config: StackConfig) -> list[list[Service]]:
    return [list(group) for _, group in groupby(services(config), key=lambda s: s.stage)]


def _await_healthy(supervisor: Supervisor, service: Service) -> None:
    log = supervisor.log_of(service.name)
    deadline = time.monotonic() + service.start_timeout_s
    while time.monotonic() < deadline:
        if service.healthy(supervisor.info(service.name).pid):
            return
        if supervisor.info(service.name).state == "FATAL":
            raise ServiceStartError(
                f"{service.name} exited repeatedly while starting; last log line: "
                f"{log_tail(log)}; log {log}"
            )
        time.sleep(POLL_S)
    info = supervisor.info(service.name)
    raise ServiceStartError(
        f"{service.name} not healthy after {service.start_timeout_s:.0f} s ({info.state}: "
        f"{service.unhealthy_because(info.pid)}; on a loaded machine, run `dpmerge stack up` "
        f"again); last log line: {log_tail(log)}; log {log}"
    )


def _after_stage(config: StackConfig, stage: list[Service]) -> None:
    names = {service.name for service in stage}
    creds = secrets_store.require(config.state_dir)
    if "s3" in names:
        s3 = S3Store(config.s3_config())
        s3.bootstrap()
        if config.database is StackDatabase.POSTGRES:
            postgres.bootstrap(config, creds)
        registry_store.reconcile(config, s3)
    if "mlflow" in names:
        provision.create_mlflow_users(config, creds)
    if "prefect" in names:
        provision.ensure_pools(config, creds)
        provision.remove_secret_block(config, creds)


def _prepare(config: StackConfig) -> None:
    """The credentials (first ``up``), the services' configuration files, the database."""
    creds = secrets_store.ensure(config.state_dir)
    key = secrets_store.workflow_key(config.state_dir)
    if config.prefect:
        worker_user.ensure(config, key)
    secrets_store.write_private(
        s3_config_file(config), json.dumps(roles.s3_identities(config, creds), indent=2)
    )
    secrets_store.write_private(mlflow_auth_file(config), roles.mlflow_auth_ini(config, creds))
    config.mlflow_dir.mkdir(parents=True, exist_ok=True)
    if config.database is StackDatabase.POSTGRES:
        postgres.initdb(config, creds)


def up(config: StackConfig) -> list[ServiceStatus]:
    """Start every service not already running, stage by stage; on a failure stop what this
    call started and raise :class:`StackError` naming the log."""
    config.state_dir.mkdir(parents=True, exist_ok=True)
    config.state_dir.chmod(0o700)
    _prepare(config)
    stages = _stages(config)
    supervisor = Supervisor(config)
    started_supervisor = supervisor.ensure_running([s for stage in stages for s in stage])
    config.save()  # after the check that a running supervisord has these settings
    started: list[Service] = []
    try:
        for stage in stages:
            for service in stage:
                if supervisor.info(service.name).active:
                    continue  # running or (re)starting: wait for its health below
                busy = [port for port in service.ports if not port_free(port)]
                if busy:
                    raise PortInUseError(
                        f"{service.name}: port {LOOPBACK}:{busy[0]} is in use by another "
                        "process; stop it or choose other ports (dpmerge stack up --help)"
                    )
                supervisor.start(service.name)
                started.append(service)
            for service in stage:
                _await_healthy(supervisor, service)
            _after_stage(config, stage)
    except BaseException:
        _stop(supervisor, list(reversed(started)))
        if started_supervisor:  # nothing of this stack ran before: leave nothing, as `down`
            supervisor.shutdown()
            processes.end(processes.marked(config.state_dir))
            worker_user.remove(config)
        raise
    return status(config)


def _stop(supervisor: Supervisor, stage: list[Service]) -> list[str]:
    """Stop the services of one stage together; their names, ``" (killed)"`` added where the
    stop took the whole ``stopwaitsecs`` (supervisord then sent SIGKILL)."""
    pending = [s for s in stage if supervisor.info(s.name).active]
    for service in pending:
        supervisor.stop(service.name)
    start = time.monotonic()
    finished: dict[str, float] = {}
    while len(finished) < len(pending):
        for service in pending:
            if service.name not in finished and not supervisor.info(service.name).active:
                finished[service.name] = time.monotonic() - start
        elapsed = time.monotonic() - start
        late = [
            s.name
            for s in pending
            if s.name not in finished and elapsed > s.stop_timeout_s + KILL_GRACE_S
        ]
        if late:
            raise StackError(f"{', '.join(late)} did not stop; log {supervisor.log_path}")
        time.sleep(POLL_S)
    return [s.name + (" (killed)" if finished[s.name] >= s.stop_timeout_s else "") for s in pending]


def down(config: StackConfig) -> list[str]:
    """Stop workers first, then the servers, then supervisord, then end any process of the
    stack still alive. Returns what it stopped, with ``" (killed)"`` where the stop signal was
    not enough, and ``orphans (pids)`` for processes no service owned any more."""
    supervisor = Supervisor(config)
    stopped = []
    if supervisor.running():
        for stage in reversed(_stages(config)):
            stopped += _stop(supervisor, list(reversed(stage)))
        supervisor.shutdown()
    left = processes.end(processes.marked(config.state_dir))
    worker_user.remove(config)
    if left:
        stopped.append(f"orphans ({', '.join(map(str, left))})")
    return stopped


def status(config: StackConfig) -> list[ServiceStatus]:
    supervisor = Supervisor(config)
    result = []
    for stage in _stages(config):
        for service in stage:
            info = supervisor.info(service.name)
            running = info.state in ("RUNNING", "STARTING")
            own = processes.descendants(info.pid) if info.pid else set()
            healthy = running and service.healthy(info.pid)
            reason = service.unhealthy_because(info.pid) if running and not healthy else None
            result.append(
                ServiceStatus(
                    name=service.name,
                    state=info.state,
                    pid=info.pid,
                    running=running,
                    healthy=healthy,
                    url=service.url,
                    log=supervisor.log_of(service.name),
                    orphans=tuple(
                        sorted(set(processes.marked(config.state_dir, service.name)) - own)
                    ),
                    reason=reason,
                    finding=worker_user.separation(config, service.name, info.pid)
                    if service.confined and running
                    else None,
                )
            )
    return _with_pool_drift(config, result)


def _with_pool_drift(config: StackConfig, statuses: list[ServiceStatus]) -> list[ServiceStatus]:
    """The worker of each pool whose base job template is not the provisioned one turned
    unhealthy, the drift its reason; the template is set back
    (docs/stack.md#roles-and-permissions). A pool Prefect does not answer with (a 503 under
    load) is unknown, so its worker is not healthy either."""
    if not any(s.name == "prefect" and s.healthy for s in statuses):
        return statuses
    creds = secrets_store.require(config.state_dir)
    reasons = {}
    for pool in config.pools:
        try:
            found = provision.pool_drift(
                config.prefect_api_url, creds.prefect_auth, [pool], repair=True
            )
        except provision.PoolReadError as error:
            reasons[worker_service(pool)] = f"its pool's template is unknown: {error}"
            continue
        for finding in found:
            reasons[worker_service(pool)] = finding.line()
    return [
        replace(s, healthy=False, reason=reasons[s.name]) if s.name in reasons else s
        for s in statuses
    ]


def export_lines(config: StackConfig, role: StackRole = StackRole.WORKFLOW) -> list[str]:
    """``export NAME=value`` lines of ``role``'s environment for a POSIX shell
    (``eval "$(dpmerge stack env --role operator)"``), then ``unset`` of every variable another
    role sets and this one does not, so a shell that switches roles keeps no credential of the
    role it leaves (and no ``$DPMERGE_SECRET_KEY``, which would win over the workflow's key
    file)."""
    env = config.client_env(role)
    others = {k for other in StackRole for k in config.client_env(other)} | {KEY_ENV, KEY_FILE_ENV}
    others -= set(env)
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()] + [
        f"unset {k}" for k in sorted(others)
    ]
