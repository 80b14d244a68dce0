"""The ``dpmerge`` console script: the library's commands plus the workflow commands and the
local stack's (``devstack``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dpmerge.cli import main as library_main

WORKFLOW_COMMANDS: dict[str, tuple[str, str]] = {
    "policy": ("flows.commands.policy", "set or apply privacy policies (emits the policy event)"),
    "demo": ("flows.commands.demo", "the main job on embedded defaults"),
    "stack": ("devstack.cli", "the local stack (S3, MLflow, Prefect) under supervisord"),
}


def main(argv: Sequence[str] | None = None) -> int:
    return library_main(argv, extra_commands=WORKFLOW_COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
