"""Where one local stack lives: ports, buckets, the state directory and ``stack.json``.

``stack.json`` in the state directory holds the configuration ``up`` used; ``down``,
``status``, ``env`` and any client that wants the tracking URI read it
(:meth:`StackConfig.load`). :meth:`StackConfig.client_env` is what a shell, a worker's flow run
or a test needs to use the stack as one role (docs/stack.md#roles-and-permissions).
"""

from __future__ import annotations

import json
import random
import socket
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dpmerge.errors import DPMergeError, OutageError
from dpmerge.locate import STACK_FILE, stack_state_dir
from dpmerge.storage import DEFAULT_AUDIT_BUCKET, DEFAULT_BUCKET, DEFAULT_STATE_BUCKET, S3Config
from dpmerge.vocabulary import StackDatabase, StackRole, choose

LOOPBACK = "127.0.0.1"
DEFAULT_PORTS = {"s3": 5001, "mlflow": 5000, "prefect": 4200, "postgres": 5433}
STORE_PORT_NAMES = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port.grpc",
    "admin.port",
)
"""``weed mini``'s flags for its internal listeners besides the S3 port (``store_ports``).
The admin server's gRPC port is ``admin.port`` + :data:`ADMIN_GRPC_OFFSET`: weed's maintenance
worker dials it there whatever ``-admin.port.grpc`` says."""
ADMIN_GRPC_OFFSET = 10000
DEFAULT_STORE_PORTS = tuple(range(5002, 5002 + len(STORE_PORT_NAMES)))
POOLS = ("cpu", "gpu")
CONFIG_FILE = STACK_FILE


class StackError(DPMergeError):
    """A stack service failed to start or stop; the message points at its log."""


class ServiceStartError(StackError, OutageError):
    """A service kept exiting or did not answer as itself in time: an outage (exit 1), not
    bad input."""


class PortInUseError(StackError):
    """A port the stack is configured to listen on is taken by another process: nothing of
    that service was started (the operator stops the other process or chooses other ports)."""


def repo_root() -> Path:
    """The source checkout holding this package, else the working directory."""
    candidate = Path(__file__).resolve().parents[1]
    return candidate if (candidate / "pyproject.toml").is_file() else Path.cwd()


def default_state_dir() -> Path:
    return stack_state_dir()


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


ADMIN_PORTS = (20000, 22700)
"""Where SeaweedFS's admin port is picked: its gRPC partner (+ :data:`ADMIN_GRPC_OFFSET`) is
then in 30000–32700, still below the ephemeral range and outside :data:`PICKED_PORTS`."""
PICKED_PORTS = (22700, 30000)
"""Where :func:`free_ports` picks: below the kernel's ephemeral range (32768–60999 by default),
so no outgoing connection of this or another process takes a picked port before its server
binds it (a port the kernel hands out as free is exactly one it may hand out again)."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on the loopback interface right now, picked at random in
    :data:`PICKED_PORTS`."""
    found: list[int] = []
    for _ in range(200 * count):
        port = random.randrange(*PICKED_PORTS)
        if port not in found and port_free(port):
            found.append(port)
            if len(found) == count:
                return found
    raise StackError(f"no {count} free ports in {PICKED_PORTS[0]}–{PICKED_PORTS[1]}")


def _free_admin_port() -> int:
    """A free port whose admin gRPC partner (+ :data:`ADMIN_GRPC_OFFSET`) is free too."""
    for _ in range(200):
        port = random.randrange(*ADMIN_PORTS)
        if port_free(port) and port_free(port + ADMIN_GRPC_OFFSET):
            return port
    raise StackError("no free port pair for SeaweedFS's admin server in 20000–32700")


WORKER_USER = "dpmerge-worker"


@dataclass(frozen=True)
class StackConfig:
    """Ports, buckets, the database and the state directory of one local stack.
    ``prefect=False`` starts only S3, the database and MLflow (what the registry tests need)."""

    state_dir: Path = field(default_factory=default_state_dir)
    s3_port: int = DEFAULT_PORTS["s3"]
    mlflow_port: int = DEFAULT_PORTS["mlflow"]
    prefect_port: int = DEFAULT_PORTS["prefect"]
    postgres_port: int = DEFAULT_PORTS["postgres"]
    store_ports: tuple[int, ...] = DEFAULT_STORE_PORTS
    database: StackDatabase = StackDatabase.POSTGRES
    bucket: str = DEFAULT_BUCKET
    audit_bucket: str = DEFAULT_AUDIT_BUCKET
    state_bucket: str = DEFAULT_STATE_BUCKET
    prefect: bool = True
    pools: tuple[str, ...] = POOLS
    worker_query_seconds: float = 0.5
    """How often a worker asks Prefect for runs: half of it is, on average, part of every
    policy change's time to policy (docs/results.md#scale-out)."""
    worker_user: str = WORKER_USER
    """Who the workers, their flow runs and the dispatcher run as when ``up`` runs as root
    (created if it is this default and missing; devstack/worker_user.py)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "state_dir", Path(self.state_dir).absolute())
        object.__setattr__(self, "pools", tuple(self.pools))
        object.__setattr__(self, "store_ports", tuple(self.store_ports))
        try:
            object.__setattr__(self, "database", choose(StackDatabase, self.database, "database"))
        except DPMergeError as error:
            raise StackError(str(error)) from None
        if len(self.store_ports) != len(STORE_PORT_NAMES):
            raise StackError(
                f"store_ports needs {len(STORE_PORT_NAMES)} ports "
                f"({', '.join(STORE_PORT_NAMES)}), got {len(self.store_ports)}"
            )
        raw = [
            self.s3_port,
            self.mlflow_port,
            self.prefect_port,
            self.postgres_port,
            *self.store_ports,
        ]
        if not all(type(p) is int for p in raw):
            raise StackError(f"ports must be integers, got {raw}")
        ports = self.ports
        if len(set(ports)) != len(ports) or not all(0 < p < 65536 for p in ports):
            raise StackError(f"ports must be distinct and in 1–65535, got {ports}")

    @classmethod
    def on_free_ports(cls, state_dir: str | Path, **fields: Any) -> StackConfig:
        """A configuration whose ports are all free on loopback right now (tests, benchmarks)."""
        s3, mlflow, prefect, postgres, *store = free_ports(3 + len(STORE_PORT_NAMES))
        return cls(
            state_dir=Path(state_dir),
            s3_port=s3,
            mlflow_port=mlflow,
            prefect_port=prefect,
            postgres_port=postgres,
            store_ports=(*store, _free_admin_port()),
            **fields,
        )

    @property
    def store_flags(self) -> dict[str, int]:
        """``weed mini``'s internal port flags and their ports."""
        flags = dict(zip(STORE_PORT_NAMES, self.store_ports, strict=True))
        return {**flags, "admin.port.grpc": flags["admin.port"] + ADMIN_GRPC_OFFSET}

    @property
    def ports(self) -> list[int]:
        """Every port this stack listens on."""
        servers = [self.s3_port, *self.store_flags.values(), self.mlflow_port]
        if self.database is StackDatabase.POSTGRES:
            servers.append(self.postgres_port)
        return servers + ([self.prefect_port] if self.prefect else [])

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

    @property
    def mlflow_dir(self) -> Path:
        return self.state_dir / "mlflow"

    @property
    def s3_dir(self) -> Path:
        return self.state_dir / "s3"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def postgres_dir(self) -> Path:
        return self.state_dir / "postgres"

    def s3_config(self) -> S3Config:
        """The stack's own S3 identity (``admin``: buckets, the store generation)."""
        from devstack.roles import admin_s3_config

        return admin_s3_config(self)

    def client_env(self, role: StackRole = StackRole.WORKFLOW) -> dict[str, str]:
        """What a shell, a worker's flow run or a test needs to use this stack as ``role``
        (its own credentials only; :func:`devstack.roles.role_env`)."""
        from devstack.roles import role_env

        return role_env(self, role)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["state_dir"] = str(self.state_dir)
        data["pools"] = list(self.pools)
        data["store_ports"] = list(self.store_ports)
        data["database"] = self.database.value
        return data

    def save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / CONFIG_FILE
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        temporary.replace(path)

    @classmethod
    def load(cls, state_dir: str | Path) -> StackConfig | None:
        """The configuration ``up`` saved in ``state_dir``, or ``None``."""
        path = Path(state_dir) / CONFIG_FILE
        if not path.is_file():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError, StackError) as error:
            raise StackError(f"{path} is not a stack configuration ({error})") from None


def resolve_config(state_dir: str | Path | None = None, **overrides: Any) -> StackConfig:
    """The saved configuration of ``state_dir`` (default :func:`default_state_dir`) with
    ``overrides`` (``None`` values ignored) applied, else defaults with the overrides."""
    directory = Path(state_dir) if state_dir is not None else default_state_dir()
    given = {k: v for k, v in overrides.items() if v is not None}
    saved = StackConfig.load(directory)
    return replace(saved, **given) if saved else StackConfig(state_dir=directory, **given)
