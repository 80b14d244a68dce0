"""The whole local stack with deployments/prefect.yaml applied, for the workflow's integration
tests: flow runs keep their state under a temporary ``DPMERGE_HOME``, and this process's
environment points at the stack."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from servers import environment, running_stack

import devstack as stack_mod

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def deployed_stack(factory: pytest.TempPathFactory) -> Iterator[stack_mod.StackConfig]:
    server_env = {
        "DPMERGE_HOME": str(factory.mktemp("dpmerge-home")),
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    }
    with (
        environment(server_env),
        running_stack(factory.mktemp("stack"), prefect=True) as config,
        environment(config.client_env()),
    ):
        deployed = subprocess.run(
            [
                *(str(Path(sys.executable).parent / "prefect"), "--no-prompt", "deploy"),
                *("--all", "--prefect-file", "deployments/prefect.yaml"),
            ],
            cwd=REPO,
            env=os.environ.copy(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]
        yield config
