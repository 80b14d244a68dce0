"""The ``--model`` value that names a user's factory, ``module:callable``
(docs/design.md#your-model), recognised and parsed without torch (the options are checked
before torch loads)."""

from __future__ import annotations

import re

from dpmerge.errors import ModelFactoryError

_NAME = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
REFERENCE = re.compile(rf"({_NAME}):({_NAME})")
"""``module:callable``: a dotted module name and a dotted attribute path in it."""


def parse_reference(text: str) -> tuple[str, str]:
    """The module and attribute path of ``module:callable``, or a one-line refusal."""
    match = REFERENCE.fullmatch(text)
    if match is None:
        raise ModelFactoryError(
            f"model {text!r} is neither a built-in model nor module:callable "
            "(e.g. mymodels:make_net)"
        )
    return match[1], match[2]
