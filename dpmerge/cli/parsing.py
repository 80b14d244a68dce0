"""The command line's parser: strict, and one clear line for every mistake.

* A bad option prints ``dpmerge: error: <command>: …`` and exits 2 (like every other refusal);
  ``--help`` shows the usage.
* An option given twice is refused, never "the last one wins" (``--target-epsilon 1
  --target-epsilon 5`` would otherwise apply 5 silently), and so is one given under two of its
  spellings (``--delta`` and ``--target-delta``).
* An unknown option is named, with the nearest known one: ``unknown option --target-epsilom;
  did you mean --target-epsilon?``, even where a required option is then missing too.
* Options are never abbreviated (``--target`` is not ``--target-epsilon``).
* A negative number is a value, also in exponent form (``--delta -1e-5`` is refused as a δ,
  not as a missing value).
* What is echoed is escaped (:func:`dpmerge.formatting.printable`).

Sub-command parsers are made of the same class, so every command, the workflow's and the local
stack's included, behaves alike. This module imports nothing heavy: ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from dpmerge.formatting import did_you_mean, printable
from dpmerge.vocabulary import ExitCode

_SEEN = "_dpmerge_options_seen"
"""Namespace attribute holding the destinations set so far (removed before parsing returns)."""
_ONCE = ("store", "store_const", "store_true", "store_false", None)
"""Action kinds that take one value: given twice, the earlier one would be lost silently.
``append`` and ``count`` repeat by design."""
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
"""A value, never an option: ``-1``, ``-0.5``, ``-.5`` and ``-1e-5`` (argparse's own pattern
misses the exponent, so ``--delta -1e-5`` read as a missing value)."""


@functools.cache
def _once(kind: type[argparse.Action]) -> type[argparse.Action]:
    """``kind``, refusing a second use of its option in one command line."""

    class Once(kind):  # type: ignore[misc, valid-type]
        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: Any,
            option_string: str | None = None,
        ) -> None:
            if option_string is not None:
                seen = namespace.__dict__.setdefault(_SEEN, {})
                if self.dest in seen:
                    earlier = seen[self.dest]
                    also = "" if earlier == option_string else f" (already given as {earlier})"
                    parser.error(f"option {option_string} given more than once{also}; give it once")
                seen[self.dest] = option_string
            super().__call__(parser, namespace, values, option_string)

    Once.__name__ = Once.__qualname__ = kind.__name__
    return Once


class Parser(argparse.ArgumentParser):
    """See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER
        for kind in _ONCE:
            self.register("action", kind, _once(self._registry_get("action", kind, kind)))
        self._given: list[str] = []

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        if self._subparsers is not None:  # a group's own options, before its command parses
            unknown = self._unknown_options(self._given)
            if unknown:
                self.error(unknown)
        parsed, extras = super().parse_known_args(args, namespace)
        parsed.__dict__.pop(_SEEN, None)
        unknown = self._unknown_options(extras)
        if unknown:
            self.error(unknown)
        return parsed, extras

    def _unknown_options(self, tokens: Sequence[str]) -> str | None:
        """``unknown option --x; did you mean --y?`` for the first token of ``tokens`` that
        looks like an option of this command and is none of its options (a group's, such as
        ``dpmerge policy``, are those before its command's name)."""
        if self._subparsers is not None:
            tokens = list(itertools.takewhile(lambda token: token.startswith("-"), tokens))
        known = sorted(self._option_string_actions)
        for token in tokens:
            if token == "--":
                return None
            name = token.split("=", 1)[0]
            if not name.startswith("-") or name == "-" or name in self._option_string_actions:
                continue
            if name[1] in "0123456789.":
                continue  # a negative number (or a list of them) is a value, not an option
            hint = did_you_mean(name, known, quoted=False) or f" (options: {', '.join(known)})"
            return f"unknown option {name}{hint}"
        return None

    def error(self, message: str) -> NoReturn:
        message = self._unknown_options(self._given) or message
        command = self.prog.removeprefix("dpmerge").strip()
        where = f"{command}: " if command else ""
        self.exit(ExitCode.REFUSED, f"dpmerge: error: {where}{printable(message)}\n")
