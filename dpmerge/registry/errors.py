"""The registry's errors: a failed or refused operation, and a refused promotion."""

from __future__ import annotations

from collections.abc import Sequence

from dpmerge.errors import DPMergeError


class RegistryError(DPMergeError):
    """A registry operation failed or was refused; the message names model and version."""


class GateError(RegistryError):
    """Promotion refused: a gate failed. The alias was not moved."""

    def __init__(self, name: str, version: str, reasons: Sequence[str]) -> None:
        super().__init__(f"{name} v{version} not promoted: " + "; ".join(reasons))
        self.reasons = tuple(reasons)
