"""A finding of a drift check: ``dpmerge registry verify`` and ``verify-state``
(docs/design.md#release-state), and the stack's check of its work pools
(docs/stack.md#roles-and-permissions). A module of its own, light to import: ``dpmerge stack
status`` reports pool drift with it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dpmerge.vocabulary import FindingKind


@dataclass(frozen=True)
class Finding:
    """One disagreement: what kind, about what, and what was done (``repaired``: ``None``
    when nothing was)."""

    kind: FindingKind
    subject: str
    detail: str
    repaired: str | None = None

    def line(self) -> str:
        tail = f" — repaired: {self.repaired}" if self.repaired else ""
        return f"{self.kind.value}: {self.subject}: {self.detail}{tail}"

    def to_dict(self) -> dict[str, str | None]:
        return {**asdict(self), "kind": self.kind.value}
