"""Real servers on loopback for integration tests, started through ``dpmerge.stack``.

``running_stack(state_dir, prefect=False)`` gives moto S3 + an MLflow server (sqlite backend,
artifacts proxied to ``s3://dpmerge/mlartifacts`` on moto); ``prefect=True`` adds the Prefect
server, the ``cpu`` and ``gpu`` process pools and one worker each. Ports are picked free on
127.0.0.1, so tests never collide with a developer's own stack on the default ports.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dpmerge import stack

TELEMETRY_OFF = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 right now."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((stack.LOOPBACK, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def stack_config(state_dir: Path, *, prefect: bool) -> stack.StackConfig:
    s3_port, mlflow_port, prefect_port = free_ports(3)
    return stack.StackConfig(
        state_dir=state_dir,
        s3_port=s3_port,
        mlflow_port=mlflow_port,
        prefect_port=prefect_port,
        prefect=prefect,
    )


@contextmanager
def running_stack(state_dir: Path, *, prefect: bool) -> Iterator[stack.StackConfig]:
    """Start a stack on free ports and stop it (workers first) on exit, even after a failure."""
    config = stack_config(state_dir, prefect=prefect)
    try:
        stack.up(config)
        yield config
    finally:
        stack.down(config)


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block and restore the previous values after."""
    previous = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
