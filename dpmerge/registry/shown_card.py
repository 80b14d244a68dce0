"""What ``registry show`` states of a release's card (docs/design.md#security).

The version's description is what MLflow's UI shows as the release's privacy card, and anyone
with the workflow's MLflow credential can edit it. So ``registry show`` states the release's
ε, δ and bound from its signed manifest, never from the description, and says whether the
description and its run's ``privacy_card.json`` are the card the manifest signs (their digest).
``dpmerge verify`` checks the same card against the signed files themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dpmerge import manifests
from dpmerge.privacy_card import CARD_JSON
from dpmerge.registry.catalog import Catalog, VersionDetail
from dpmerge.registry.tags import MANIFEST_TAG, SIGNATURE_TAG
from dpmerge.vocabulary import CardCheck


@dataclass(frozen=True)
class ShownCard:
    """The signed facts of a release (empty unless its signature verified) and the check."""

    check: CardCheck
    why: str
    key: str = ""
    facts: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check.value, "why": self.why, "key": self.key, "facts": self.facts}


def check_shown_card(catalog: Catalog, detail: VersionDetail, public_key: str | None) -> ShownCard:
    """The check of release ``detail``'s card under ``public_key`` (``None``: not given)."""
    if public_key is None:
        return ShownCard(
            CardCheck.UNCHECKED,
            f"no release public key: set {manifests.PUBLIC_KEY_ENV} or pass --public-key",
        )
    tags, key = detail.stored.tags, manifests.fingerprint(public_key)
    try:
        manifest = manifests.verify(tags.get(MANIFEST_TAG), tags.get(SIGNATURE_TAG), public_key)
        manifests.check_facts(manifest, tags)
    except manifests.ReleaseSignatureError as error:
        return ShownCard(CardCheck.UNSIGNED, str(error), key)
    facts = dict(manifest.facts)
    card = catalog.run_card(detail.stored.run_id) if detail.stored.run_id else None
    if card is None:
        why = f"the run's {CARD_JSON} cannot be read"
        return ShownCard(CardCheck.UNCHECKED, why, key, facts)
    if manifests.card_digest(detail.description, card) != manifest.card_digest:
        why = (
            f"the description or the run's {CARD_JSON} differs from the card its manifest "
            "signs: it was edited after registration"
        )
        return ShownCard(CardCheck.EDITED, why, key, facts)
    return ShownCard(CardCheck.SIGNED, "the card below is the signed one", key, facts)
