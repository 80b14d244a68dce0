"""The ``dpmerge`` command line: a stable interface other tools script against.

Each subcommand lives in its own module exposing ``register(subparsers)``; the module's
handler returns the process exit code. Errors dpmerge raises on purpose print one line on
stderr (echoed input escaped), and the exit status comes from the error's type through one
table, :func:`dpmerge.exits.exit_code`: 1 an outage, 2 bad input or a refusal, 3 an infeasible
target, 4 not promoted; Ctrl-C ends quietly with 130. Options are parsed strictly
(:mod:`dpmerge.cli.parsing`).

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

from dpmerge.cli.parsing import Parser
from dpmerge.environment import QUIET
from dpmerge.errors import DPMergeError
from dpmerge.formatting import did_you_mean
from dpmerge.vocabulary import ExitCode

COMMANDS: dict[str, tuple[str, str]] = {
    "account": (
        "dpmerge.cli.account",
        "privacy of a merge (given weights) or the best merge for a target ε",
    ),
    "study": ("dpmerge.cli.study", "reproduce an experiment of docs/design.md#studies"),
    "train": ("dpmerge.cli.train", "train one DP-SGD candidate"),
    "merge": ("dpmerge.cli.model_options", "merge candidate directories (RS, LC or mixture)"),
    "evaluate": ("dpmerge.cli.model_options", "evaluate a model directory on a split"),
    "candidates": (
        "dpmerge.cli.candidates",
        "list candidate directories as a candidates file, or import a DP model",
    ),
    "registry": ("dpmerge.cli.registry", "the MLflow model registry"),
    "ledger": (
        "dpmerge.cli.ledger",
        "the release ledger: its bound now, or add back what a rollback lost",
    ),
    "state": ("dpmerge.cli.ledger", "the release-state store (restore a damaged document)"),
    "verify": ("dpmerge.cli.verify", "check a release's signature and files before serving it"),
    "serve": ("dpmerge.cli.serve", "verify a release, then serve exactly the verified files"),
}
"""Command name → (module defining it, one-line help)."""

EXIT_BAD_INPUT = ExitCode.REFUSED
"""Kept for callers that name it; every status is an :class:`~dpmerge.vocabulary.ExitCode`."""


def build_parser(
    extra_commands: Mapping[str, tuple[str, str]] | None = None, command: str | None = None
) -> argparse.ArgumentParser:
    """The parser with ``command``'s module registered; the others appear by name and help."""
    table = {**COMMANDS, **(extra_commands or {})}
    parser = Parser(
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
    for name, value in QUIET.items():  # a command's output is its own lines: no progress bars
        os.environ.setdefault(name, value)
    try:
        command, table = _command(argv), {**COMMANDS, **(extra_commands or {})}
        parser = build_parser(extra_commands, command)
        if command is not None and command not in table:
            hint = did_you_mean(command, table) or f" (commands: {', '.join(table)})"
            parser.error(f"unknown command {command!r}{hint}")
        args = parser.parse_args(argv)
        return int(args.handler(args) or 0)
    except (DPMergeError, KeyboardInterrupt, BrokenPipeError) as error:
        return _ended(error)


def _ended(error: BaseException) -> int:
    """One line on stderr for an error dpmerge raised on purpose, nothing for a closed pipe,
    ``interrupted`` for Ctrl-C; the status from :func:`dpmerge.exits.exit_code`."""
    from dpmerge.exits import exit_code
    from dpmerge.formatting import printable

    code = exit_code(error)
    if isinstance(error, BrokenPipeError):  # the reader went away (``dpmerge … | head``)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    elif isinstance(error, KeyboardInterrupt):
        print("dpmerge: interrupted", file=sys.stderr)
    else:
        label = "infeasible" if code == ExitCode.INFEASIBLE else "error"
        print(f"dpmerge: {label}: {printable(str(error))}", file=sys.stderr)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
