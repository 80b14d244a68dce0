"""The ``dpmerge`` command line: a stable interface other tools script against.

Each subcommand lives in its own module exposing ``register(subparsers)``; the module's
handler returns the process exit code. Errors dpmerge raises on purpose print one line on
stderr: exit 2 for bad input or a refused analysis, 3 for an infeasible target.

Only the module of the command being run is imported (torch, MLflow and dp_accounting take
seconds to import), so ``dpmerge --help`` and every command start fast. The library's commands
live here and import no Prefect; the workflow commands (``policy``, ``demo``) and the local
stack's (``stack``, in the ``devstack`` package) live outside the library, and ``flows.cli``
adds them to this table: the console script enters there, so the dependencies keep pointing
at the library (flows → tasks → dpmerge, devstack → dpmerge).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

from dpmerge.errors import DPMergeError, InfeasibleTargetError

COMMANDS: dict[str, tuple[str, str]] = {
    "account": (
        "dpmerge.cli.account",
        "privacy of a merge (given weights) or the best merge for a target ε",
    ),
    "study": ("dpmerge.cli.study", "reproduce an experiment of docs/design.md#studies"),
    "train": ("dpmerge.cli.train", "train one DP-SGD candidate"),
    "merge": ("dpmerge.cli.models", "merge candidate directories (RS, LC or mixture)"),
    "evaluate": ("dpmerge.cli.models", "evaluate a model directory on a split"),
    "candidates": ("dpmerge.cli.models", "print the candidates file of candidate directories"),
    "registry": ("dpmerge.cli.registry", "the MLflow model registry"),
    "ledger": ("dpmerge.cli.ledger", "the release ledger (rebuild it from the registry)"),
}
"""Command name → (module defining it, one-line help)."""

EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3
EXIT_BROKEN_PIPE = 141
"""As a shell reports a command killed by SIGPIPE (128 + 13)."""


class _Parser(argparse.ArgumentParser):
    """Bad options print one line (``dpmerge: error: <command>: …``), exit 2, like every other
    refusal; ``--help`` shows the usage."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("dpmerge").strip()
        where = f"{command}: " if command else ""
        self.exit(EXIT_BAD_INPUT, f"dpmerge: error: {where}{message}\n")


def build_parser(
    extra_commands: Mapping[str, tuple[str, str]] | None = None, command: str | None = None
) -> argparse.ArgumentParser:
    """The parser with ``command``'s module registered; the others appear by name and help."""
    table = {**COMMANDS, **(extra_commands or {})}
    parser = _Parser(
        prog="dpmerge",
        description="Differentially private model merging: account, calibrate, train, merge.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    if command in table:
        importlib.import_module(table[command][0]).register(subparsers)
    else:
        for name, (_, text) in table.items():
            subparsers.add_parser(name, help=text)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(
    argv: Sequence[str] | None = None, extra_commands: Mapping[str, tuple[str, str]] | None = None
) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(extra_commands, _command(argv)).parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except InfeasibleTargetError as error:
        print(f"dpmerge: infeasible: {error}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except DPMergeError as error:
        print(f"dpmerge: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # the reader went away (``dpmerge … | head``): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
