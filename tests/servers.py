"""Real servers on loopback for integration tests, started through ``devstack``.

``running_stack(state_dir, prefect=False)`` gives S3 (SeaweedFS) + an MLflow server (sqlite
backend, artifacts proxied to ``s3://dpmerge/mlartifacts``); ``prefect=True`` adds the Prefect
server, the ``cpu`` and ``gpu`` process pools and one worker each. Ports are picked free on
127.0.0.1, so tests never collide with a developer's own stack on the default ports.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import devstack


@contextmanager
def running_stack(state_dir: Path, *, prefect: bool) -> Iterator[devstack.StackConfig]:
    """Start a stack on free ports and stop it (workers first) on exit, even after a failure."""
    config = devstack.StackConfig.on_free_ports(state_dir, prefect=prefect)
    try:
        devstack.up(config)
        yield config
    finally:
        devstack.down(config)


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
