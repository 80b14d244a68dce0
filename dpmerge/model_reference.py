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


def misplaced_factory_options(model: str, model_path: str | None, fix_model: bool) -> str | None:
    """Why the factory's options cannot go with ``model`` (``None``: they can): they apply only
    to a factory, not to a built-in model."""
    if ":" in model:
        return None
    given = [f for f, v in (("model_path", model_path), ("fix_model", fix_model)) if v]
    if not given:
        return None
    return (
        f"{', '.join(given)} applies only to a model factory (module:callable), not to the "
        f"built-in {model!r}"
    )
