"""The local development stack: SeaweedFS S3, an MLflow server, a Prefect server, work pools and
workers on loopback, run by supervisord (docs/stack.md).

Not part of the DP library: ``devstack`` depends on ``dpmerge`` (its storage adapter and
environment switches), never the other way round. ``dpmerge stack up|down|status|env`` is its
command line (:mod:`devstack.cli`).
"""

from devstack.config import (
    CONFIG_FILE,
    DEFAULT_PORTS,
    LOOPBACK,
    StackConfig,
    StackError,
    free_ports,
    port_free,
    resolve_config,
)
from devstack.processes import alive as pid_alive
from devstack.processes import group_members
from devstack.stack import ServiceStatus, down, export_lines, status, up

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_PORTS",
    "LOOPBACK",
    "ServiceStatus",
    "StackConfig",
    "StackError",
    "down",
    "export_lines",
    "free_ports",
    "group_members",
    "pid_alive",
    "port_free",
    "resolve_config",
    "status",
    "up",
]
