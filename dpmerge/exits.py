"""One table from an error's type to a command's exit status (README, "Outcomes";
docs/design.md#workflow): 0 ok, 1 an outage or a bug, 2 bad input or a refusal, 3 infeasible,
4 not promoted, 5 superseded. Every ``dpmerge`` command ends through :func:`exit_code`; the
policy commands map their outcome documents onto the same :class:`~dpmerge.vocabulary.ExitCode`.
"""

from __future__ import annotations

from dpmerge.errors import (
    BoundContradictionError,
    DPMergeError,
    InfeasibleTargetError,
    NotPromotedError,
    OutageError,
)
from dpmerge.vocabulary import ExitCode

EXIT_CODES: tuple[tuple[type[BaseException], ExitCode], ...] = (
    (InfeasibleTargetError, ExitCode.INFEASIBLE),
    (NotPromotedError, ExitCode.NOT_PROMOTED),
    (OutageError, ExitCode.FAILURE),
    (BoundContradictionError, ExitCode.FAILURE),  # two bounds disagree: a bug in one of them
    (DPMergeError, ExitCode.REFUSED),  # bad input, a refused analysis, a failed check
    (KeyboardInterrupt, ExitCode.INTERRUPTED),
    (BrokenPipeError, ExitCode.BROKEN_PIPE),
)
"""First match wins, so a more specific type comes before its base."""


def exit_code(error: BaseException) -> ExitCode:
    """The exit status of a command that ended with ``error``; anything unforeseen is a bug
    (1)."""
    for kind, code in EXIT_CODES:
        if isinstance(error, kind):
            return code
    return ExitCode.FAILURE
