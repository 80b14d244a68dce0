"""The ``dpmerge`` command line: a stable interface other tools script against.

Each subcommand lives in its own module exposing ``register(subparsers)``; the module's
handler returns the process exit code. Errors dpmerge raises on purpose print one line on
stderr: exit 2 for bad input or a refused analysis, 3 for an infeasible target.

The library's commands live here and import no Prefect. The workflow commands (``policy``,
``demo``) live in ``flows.cli``, which adds them to this parser: the console script enters
there, so the dependency direction stays flows → tasks → dpmerge.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from dpmerge.errors import DPMergeError, InfeasibleTargetError

SUBCOMMAND_MODULES = tuple(
    f"dpmerge.cli.{name}" for name in ("account", "study", "train", "models", "registry", "stack")
)

EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3


def build_parser(extra_modules: Sequence[str] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpmerge",
        description="Differentially private model merging: account, calibrate, train, merge.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in (*SUBCOMMAND_MODULES, *extra_modules):
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None, extra_modules: Sequence[str] = ()) -> int:
    args = build_parser(extra_modules).parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except InfeasibleTargetError as error:
        print(f"dpmerge: infeasible: {error}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except DPMergeError as error:
        print(f"dpmerge: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
