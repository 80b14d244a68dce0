"""The public privacy card of a release: what a consumer of the release reads.

Everything on it is a function of the released model, public data and the test rows (whose
protection it states): the guarantee and the bounds' values, the target, the method and how
many candidates and merges it combined, the test accuracy, the cumulative ledger bound, and the
number of earlier attempts for the policy. It names no candidate, no candidate version, record,
lineage or metric, no weight and no assumption text (which names release units): those are on
the internal card (:mod:`dpmerge.privacy_card`), kept in the release-state store
(docs/design.md#release-state, docs/design.md#row-protection). Like the internal card it computes
no ε; displayed ε values are rounded up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dpmerge.formatting import epsilon_text
from dpmerge.privacy_card import (
    ACCURACY_KEYS,
    BOUND_LABELS,
    LEDGER_NOTE,
    METHODS,
    PrivacyCard,
    accuracy_value,
    attempts_lines,
    bound_rows,
    headline,
    library_versions,
    num,
    row_protection,
    rows_section,
    software_section,
    utility_lines,
)

BOUND_KEYS = (
    "kind",
    "epsilon",
    "delta",
    "accountant",
    "epsilon_pld",
    "epsilon_rdp",
    "rdp_order",
    "discretisation",
    "neighbouring",
)
LEDGER_KEYS = ("epsilon", "delta", "accountant", "cap", "releases")
INTERNAL_NOTE = (
    "The candidates this release was merged from, their mechanism records, metrics and the "
    "merge weights are internal (operators read them on the internal card: `dpmerge registry "
    "show NAME/VERSION --internal`); publishing them, or anything computed from the candidates, "
    "voids this guarantee."
)
DRAW_NOTE = (
    "This model is one of {count} {what} drawn secretly with probabilities fixed from the "
    "mechanism records alone; which one is part of the mechanism's randomness and is recorded "
    "nowhere public (docs/design.md#rs-secrecy)."
)


def _bound(bound: Mapping[str, Any]) -> dict[str, Any]:
    return {k: bound.get(k) for k in BOUND_KEYS if k in bound}


def _combined(report: Mapping[str, Any]) -> tuple[str, dict[str, Any], list[str]]:
    """The merge line, its JSON and the draw note: counts only."""
    method = report["method"]
    used = len(report.get("used_candidates") or report["candidates"])
    data: dict[str, Any] = {"method": method, "candidates": used}
    notes = []
    if method == "mixture":
        merges = len(report.get("rungs") or ())
        data["merges"] = merges
        notes.append(DRAW_NOTE.format(count=merges, what="LC merges of the candidates"))
        text = f"a secret draw between {merges} LC merges of {used} candidates"
    elif method == "rs":
        notes.append(DRAW_NOTE.format(count=used, what="candidates"))
        text = f"one of {used} candidates, drawn secretly"
    else:
        text = f"a weighted average of {used} candidates"
    return f"Method: **{METHODS[method]}** — {text}.", data, notes


def build_public_card(
    report: Mapping[str, Any],
    *,
    target_epsilon: float,
    target_delta: float,
    model_name: str | None,
    policy_id: str | None,
    ledger: Mapping[str, Any] | None,
    metrics: Mapping[str, Any],
    tuned: bool,
    notes: Sequence[str] = (),
) -> PrivacyCard:
    """The public card of the release ``report`` (a ``PrivacyReport.to_dict()``) describes;
    ``metrics`` are the released model's, ``ledger`` the cumulative bound with it counted,
    ``tuned``: its weights were tuned on validation accuracy; ``notes`` (e.g. why it spends less
    than the target) must follow from the records and the target alone."""
    head = headline(
        report,
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        model_name=model_name,
        policy_id=policy_id,
        audience="public",
    )
    bounds = {
        kind: _bound(bound)
        for kind, bound in report["bounds"].items()
        if kind in ("gating", "generic", "structured") and bound
    }
    merge_line, merge, drawn = _combined(report)
    md = [
        *head.markdown,
        *attempts_lines(ledger or {}, listed=False),
        *utility_lines(metrics),
        *rows_section(tuned),
        "## Bounds",
        "",
        "| bound | accountant | ε | δ | setting |",
        "|---|---|---|---|---|",
    ]
    for kind, bound in bounds.items():
        label = BOUND_LABELS.get(str(bound.get("kind", kind)), kind)
        if bound.get("epsilon") is None:
            md.append(f"| {kind}: {label} | — | not available | — | — |")
            continue
        md += [f"| {kind}: {label} {row}" for row in bound_rows(bound)]
    md += ["", "## Merge", "", merge_line, ""]
    public_ledger = None
    if ledger is not None:
        public_ledger = {k: ledger.get(k) for k in LEDGER_KEYS}
        public_ledger["attempts"] = len(ledger.get("attempts") or ())
        md += [
            "## Release ledger (cumulative)",
            "",
            f"All releases from this dataset together: ε = "
            f"**{epsilon_text(ledger.get('epsilon'))}** at δ = {num(ledger.get('delta'))} "
            f"({str(ledger.get('accountant')).upper()}, {ledger.get('releases')} release(s)"
            + (f", cap ε = {ledger['cap']:g}" if ledger.get("cap") is not None else "")
            + ").",
            "",
        ]
    notes = [*notes, *drawn, INTERNAL_NOTE, *([LEDGER_NOTE] if ledger is not None else [])]
    versions = library_versions()
    md += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    md += software_section(versions)
    data = {
        **head.data,
        "bounds": bounds,
        "merge": merge,
        "ledger": public_ledger,
        "accuracy": {k: accuracy_value(metrics, k) for k in ACCURACY_KEYS},
        "rows": row_protection(tuned),
        "notes": notes,
        "libraries": versions,
    }
    return PrivacyCard("\n".join(md), data)
