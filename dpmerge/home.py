"""The local state directory (docs/design.md#workflow): ``$DPMERGE_HOME``, else ``./.dpmerge``.
It holds the embedded registry, caches, and the workflow's generated secret key
(docs/design.md#security)."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "DPMERGE_HOME"
DEFAULT_HOME = ".dpmerge"


def resolve_home(home: str | Path | None = None) -> Path:
    """The local state directory: ``home``, else ``$DPMERGE_HOME``, else ``./.dpmerge``."""
    return Path(home or os.environ.get(HOME_ENV) or Path.cwd() / DEFAULT_HOME).absolute()
