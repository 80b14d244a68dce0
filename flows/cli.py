"""The ``dpmerge`` console script: the library's commands plus the workflow commands."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dpmerge.cli import main as library_main

WORKFLOW_COMMANDS: tuple[str, ...] = ("flows.commands.policy", "flows.commands.demo")


def main(argv: Sequence[str] | None = None) -> int:
    return library_main(argv, extra_modules=WORKFLOW_COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
