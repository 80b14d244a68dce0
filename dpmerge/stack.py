"""The local stack on loopback: moto S3, MLflow server, Prefect server, work pools, workers.

``up`` starts, in order: a moto S3 server, the buckets (:meth:`S3Store.bootstrap`), an MLflow
server (sqlite backend under the state directory, artifacts proxied to
``s3://<bucket>/mlartifacts``, job execution off, one worker), a Prefect server (its own
``PREFECT_HOME`` under the state directory), the process work pools ``cpu`` and ``gpu`` and one
worker per pool (polling every second). Each service runs in its own session (process group)
with a pid file and a log under the state directory; ``down`` stops workers first, then the
servers (SIGTERM to the group, wait, SIGKILL). Telemetry is off everywhere.

moto keeps S3 in memory: objects live as long as the ``s3`` service. When ``up`` has to start
S3 afresh while an MLflow database from before exists, that database (whose artifacts are gone)
is moved aside to ``mlflow.stale-<time>`` and MLflow starts empty (see docs/stack.md).

Everything goes through subprocesses and HTTP: Prefect and MLflow are not imported here.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from itertools import groupby
from pathlib import Path
from typing import Any

from dpmerge.errors import DPMergeError
from dpmerge.storage import DEFAULT_AUDIT_BUCKET, DEFAULT_BUCKET, S3Config, S3Store, StorageError

LOOPBACK = "127.0.0.1"
DEFAULT_PORTS = {"s3": 5001, "mlflow": 5000, "prefect": 4200}
POOLS = ("cpu", "gpu")
CONFIG_FILE = "stack.json"
MOTO_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
TELEMETRY_OFF = {"MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


logger = logging.getLogger(__name__)


class StackError(DPMergeError):
    """A stack service failed to start or stop; the message points at its log."""


def repo_root() -> Path:
    """The source checkout holding this package, else the working directory."""
    candidate = Path(__file__).resolve().parents[1]
    return candidate if (candidate / "pyproject.toml").is_file() else Path.cwd()


def default_state_dir() -> Path:
    return Path(os.environ.get("DPMERGE_STACK_DIR") or repo_root() / ".stack")


@dataclass(frozen=True)
class StackConfig:
    """Ports, buckets and the state directory of one local stack. ``prefect=False`` starts
    only S3 and MLflow (what the registry tests need)."""

    state_dir: Path = field(default_factory=default_state_dir)
    s3_port: int = DEFAULT_PORTS["s3"]
    mlflow_port: int = DEFAULT_PORTS["mlflow"]
    prefect_port: int = DEFAULT_PORTS["prefect"]
    bucket: str = DEFAULT_BUCKET
    audit_bucket: str = DEFAULT_AUDIT_BUCKET
    prefect: bool = True
    pools: tuple[str, ...] = POOLS
    worker_query_seconds: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "state_dir", Path(self.state_dir).absolute())
        object.__setattr__(self, "pools", tuple(self.pools))
        ports = [self.s3_port, self.mlflow_port] + ([self.prefect_port] if self.prefect else [])
        if len(set(ports)) != len(ports) or not all(0 < p < 65536 for p in ports):
            raise StackError(f"ports must be distinct and in 1–65535, got {ports}")

    @property
    def s3_url(self) -> str:
        return f"http://{LOOPBACK}:{self.s3_port}"

    @property
    def mlflow_url(self) -> str:
        return f"http://{LOOPBACK}:{self.mlflow_port}"

    @property
    def prefect_api_url(self) -> str:
        return f"http://{LOOPBACK}:{self.prefect_port}/api"

    @property
    def prefect_home(self) -> Path:
        return self.state_dir / "prefect"

    def s3_config(self) -> S3Config:
        return S3Config(
            endpoint_url=self.s3_url,
            bucket=self.bucket,
            audit_bucket=self.audit_bucket,
            access_key_id=MOTO_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret_access_key=MOTO_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )

    def client_env(self) -> dict[str, str]:
        """What a shell (or a worker's flow run) needs to use this stack."""
        env = {
            "MLFLOW_TRACKING_URI": self.mlflow_url,
            "DPMERGE_S3_ENDPOINT_URL": self.s3_url,
            "DPMERGE_S3_BUCKET": self.bucket,
            "DPMERGE_S3_AUDIT_BUCKET": self.audit_bucket,
            **MOTO_CREDENTIALS,
            **TELEMETRY_OFF,
        }
        if self.prefect:
            env["PREFECT_API_URL"] = self.prefect_api_url
        return env

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["state_dir"] = str(self.state_dir)
        data["pools"] = list(self.pools)
        return data

    @classmethod
    def load(cls, state_dir: str | Path) -> StackConfig | None:
        """The configuration ``up`` saved in ``state_dir``, or ``None``."""
        path = Path(state_dir) / CONFIG_FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            return cls(**{**data, "pools": tuple(data["pools"])})
        except (json.JSONDecodeError, TypeError, KeyError) as error:
            raise StackError(f"{path} is not a stack configuration ({error})") from None


@dataclass(frozen=True)
class Service:
    """One process of the stack: how to start it and how to tell it is healthy."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    health: Callable[[], bool]
    marker: str
    url: str | None = None
    start_timeout_s: float = 60.0
    stop_timeout_s: float = 10.0
    cwd: Path | None = None
    stage: int = 0  # services of one stage start together, after the previous stage is healthy


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    pid: int | None
    running: bool
    healthy: bool
    url: str | None
    log: Path

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "log": str(self.log)}


# --- process helpers ---------------------------------------------------------------------

_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def _pid_file(config: StackConfig, name: str) -> Path:
    return config.state_dir / "pids" / f"{name}.pid"


def _log_file(config: StackConfig, name: str) -> Path:
    return config.state_dir / "logs" / f"{name}.log"


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``, from /proc."""
    child = _CHILDREN.get(pgid)
    if child is not None and child.poll() is not None:
        _CHILDREN.pop(pgid, None)  # reaped: a zombie leader would look alive
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _running_pid(config: StackConfig, service: Service) -> int | None:
    """The pid in the service's pid file while its process group lives (even if the leader
    died and a child remains); ``None`` and the stale pid file removed otherwise."""
    path = _pid_file(config, service.name)
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    members = _group_members(pid)
    if not members:
        path.unlink(missing_ok=True)
        return None
    if pid in members:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            cmdline = ""
        if service.marker not in cmdline:
            return None  # not ours: the pid was reused by an unrelated session leader
    return pid


def _http_ok(url: str, *, method: str = "GET", body: Any = None, timeout: float = 2.0) -> Any:
    """The decoded response (JSON where possible) of a 2xx answer, else ``None``."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text)


def _executable(name: str) -> str:
    local = Path(sys.executable).parent / name
    found = str(local) if local.is_file() else shutil.which(name)
    if found is None:
        raise StackError(f"{name!r} not found next to {sys.executable} or on PATH")
    return found


def _spawn(config: StackConfig, service: Service, port: int | None) -> subprocess.Popen[bytes]:
    if port is not None and not _port_free(port):
        raise StackError(
            f"{service.name}: port {LOOPBACK}:{port} is in use by another process; "
            "stop it or choose another port (dpmerge stack up --help)"
        )
    log_path = _log_file(config, service.name)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _pid_file(config, service.name).parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **TELEMETRY_OFF, **service.env}
    with log_path.open("ab") as log:
        log.write(f"\n=== {time.strftime('%F %T')} {shlex.join(service.argv)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            service.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=service.cwd,
            start_new_session=True,
        )
    _CHILDREN[process.pid] = process
    _pid_file(config, service.name).write_text(f"{process.pid}\n")
    return process


def _await_healthy(
    config: StackConfig, service: Service, process: subprocess.Popen[bytes], since: float
) -> None:
    log_path = _log_file(config, service.name)
    deadline = since + service.start_timeout_s
    while time.monotonic() < deadline:
        if service.health():
            return
        if process.poll() is not None:
            raise StackError(
                f"{service.name} exited with code {process.returncode} while starting; "
                f"log {log_path}:\n{_log_tail(log_path)}"
            )
        time.sleep(0.2)
    raise StackError(
        f"{service.name} not healthy after {service.start_timeout_s:.0f} s; "
        f"log {log_path}:\n{_log_tail(log_path)}"
    )


def _stop_group(pgid: int, timeout_s: float) -> bool:
    """SIGTERM the group, wait up to ``timeout_s``, then SIGKILL. True if it needed SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return sig == signal.SIGKILL
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _group_members(pgid):
                return sig == signal.SIGKILL
            time.sleep(0.1)
    if _group_members(pgid):
        raise StackError(f"process group {pgid} survived SIGKILL")
    return True


# --- the services ------------------------------------------------------------------------


def _services(config: StackConfig) -> list[tuple[Service, int | None]]:
    """Every service in start order, with the port it listens on (``None``: a worker)."""
    s3_env = {**MOTO_CREDENTIALS}
    services: list[tuple[Service, int | None]] = [
        (
            Service(
                name="s3",
                argv=(_executable("moto_server"), "-H", LOOPBACK, "-p", str(config.s3_port)),
                env=s3_env,
                health=lambda: _http_ok(f"{config.s3_url}/") is not None,
                marker="moto_server",
                url=config.s3_url,
                start_timeout_s=30.0,
            ),
            config.s3_port,
        ),
        (
            Service(
                name="mlflow",
                argv=(
                    _executable("mlflow"),
                    "server",
                    "--backend-store-uri",
                    f"sqlite:///{config.state_dir / 'mlflow' / 'mlflow.db'}",
                    "--artifacts-destination",
                    config.s3_config().mlflow_artifacts_uri,
                    "--host",
                    LOOPBACK,
                    "--port",
                    str(config.mlflow_port),
                    "--workers",
                    "1",
                ),
                env={
                    **s3_env,
                    "MLFLOW_S3_ENDPOINT_URL": config.s3_url,
                    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
                },
                health=lambda: _http_ok(f"{config.mlflow_url}/health") is not None,
                marker="mlflow server",
                url=config.mlflow_url,
                start_timeout_s=120.0,
                stage=1,
            ),
            config.mlflow_port,
        ),
    ]
    if not config.prefect:
        return services
    prefect_env = {"PREFECT_HOME": str(config.prefect_home)}
    services.append(
        (
            Service(
                name="prefect",
                argv=(
                    _executable("prefect"),
                    "server",
                    "start",
                    "--host",
                    LOOPBACK,
                    "--port",
                    str(config.prefect_port),
                ),
                env={**prefect_env, "PREFECT_API_URL": config.prefect_api_url},
                health=lambda: _http_ok(f"{config.prefect_api_url}/health") is True,
                marker="prefect server start",
                url=config.prefect_api_url,
                start_timeout_s=120.0,
                stage=1,
            ),
            config.prefect_port,
        )
    )
    for pool in config.pools:
        worker_env = {
            **config.client_env(),
            **prefect_env,
            "PREFECT_WORKER_QUERY_SECONDS": str(config.worker_query_seconds),
        }
        if pool == "cpu":
            worker_env["CUDA_VISIBLE_DEVICES"] = ""
        services.append(
            (
                Service(
                    name=f"worker-{pool}",
                    argv=(
                        _executable("prefect"),
                        "worker",
                        "start",
                        "--pool",
                        pool,
                        "--type",
                        "process",
                        "--name",
                        _worker_name(pool),
                    ),
                    env=worker_env,
                    health=lambda pool=pool: _worker_online(config, pool),
                    marker=f"worker start --pool {pool}",
                    start_timeout_s=90.0,
                    stop_timeout_s=20.0,
                    cwd=repo_root(),
                    stage=2,
                ),
                None,
            )
        )
    return services


def _worker_name(pool: str) -> str:
    return f"dpmerge-{pool}"


def _worker_online(config: StackConfig, pool: str) -> bool:
    url = f"{config.prefect_api_url}/work_pools/{pool}/workers/filter"
    workers = _http_ok(url, method="POST", body={})
    return isinstance(workers, list) and any(
        w.get("name") == _worker_name(pool) and w.get("status") == "ONLINE" for w in workers
    )


def _retire_stale_mlflow(config: StackConfig) -> None:
    """moto keeps S3 in memory: a fresh S3 server has none of the artifacts an existing MLflow
    database refers to. Move that database aside (kept, renamed) so the registry starts empty
    and consistent; leave it if an MLflow server still uses it."""
    directory = config.state_dir / "mlflow"
    if not (directory / "mlflow.db").is_file():
        return
    mlflow_service = next(s for s, _ in _services(config) if s.name == "mlflow")
    if _running_pid(config, mlflow_service) is not None:
        logger.warning("S3 restarts empty under a running MLflow server: its artifacts are gone")
        return
    retired = directory.with_name(f"mlflow.stale-{time.strftime('%Y%m%d-%H%M%S')}")
    directory.rename(retired)
    logger.warning(
        "S3 (moto) keeps objects in memory and was restarted: the previous MLflow registry "
        "pointed at lost artifacts and was moved to %s; starting an empty one",
        retired,
    )


# --- public API ----------------------------------------------------------------------------


def up(config: StackConfig) -> list[ServiceStatus]:
    """Start every service not already running, stage by stage (the servers of one stage
    start together); on a failure stop what this call started and raise :class:`StackError`
    naming the log. Workers create their work pools (type ``process``) when missing."""
    config.state_dir.mkdir(parents=True, exist_ok=True)
    (config.state_dir / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2))
    started: list[tuple[Service, int]] = []
    try:
        for _, stage in groupby(_services(config), key=lambda item: item[0].stage):
            pending = []
            for service, port in stage:
                if _running_pid(config, service) is not None and service.health():
                    continue
                if service.name == "s3":
                    _retire_stale_mlflow(config)
                process = _spawn(config, service, port)
                started.append((service, process.pid))
                pending.append((service, process, time.monotonic()))
            for service, process, since in pending:
                _await_healthy(config, service, process, since)
            if any(service.name == "s3" for service, _, _ in pending):
                try:
                    S3Store(config.s3_config()).bootstrap()
                except StorageError as error:
                    raise StackError(f"bucket bootstrap failed: {error}") from None
    except BaseException:
        for service, pid in reversed(started):
            _stop_group(pid, service.stop_timeout_s)
            _pid_file(config, service.name).unlink(missing_ok=True)
        raise
    return status(config)


def down(config: StackConfig) -> list[str]:
    """Stop workers first, then the servers (SIGTERM, wait, SIGKILL). Returns what it stopped,
    with ``" (killed)"`` where SIGTERM was not enough."""
    stopped = []
    for service, _ in reversed(_services(config)):
        pid = _running_pid(config, service)
        if pid is not None:
            killed = _stop_group(pid, service.stop_timeout_s)
            stopped.append(service.name + (" (killed)" if killed else ""))
        _pid_file(config, service.name).unlink(missing_ok=True)
    return stopped


def status(config: StackConfig) -> list[ServiceStatus]:
    result = []
    for service, _ in _services(config):
        pid = _running_pid(config, service)
        result.append(
            ServiceStatus(
                name=service.name,
                pid=pid,
                running=pid is not None,
                healthy=pid is not None and service.health(),
                url=service.url,
                log=_log_file(config, service.name),
            )
        )
    return result


def export_lines(config: StackConfig) -> list[str]:
    """``export NAME=value`` lines for a POSIX shell (``eval "$(dpmerge stack env)"``)."""
    return [f"export {k}={shlex.quote(v)}" for k, v in config.client_env().items()]


def resolve_config(state_dir: str | Path | None = None, **overrides: Any) -> StackConfig:
    """The saved configuration of ``state_dir`` (default :func:`default_state_dir`) with
    ``overrides`` (``None`` values ignored) applied, else defaults with the overrides."""
    directory = Path(state_dir) if state_dir is not None else default_state_dir()
    given = {k: v for k, v in overrides.items() if v is not None}
    saved = StackConfig.load(directory)
    return replace(saved, **given) if saved else StackConfig(state_dir=directory, **given)
