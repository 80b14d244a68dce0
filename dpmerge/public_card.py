"""The public privacy card of a release: what a consumer of the release reads.

Everything on it is a function of the released model, public data and the test rows (whose
protection it states): the guarantee and the bounds' values, the target, the method and how
many candidates and merges it combined, the test accuracy (for a policy's release an ε-DP
estimate, its ε and n_test: docs/design.md#row-protection), the cumulative ledger bound as of
the time it states, the number of earlier attempts for the policy, the warning when δ is weak
for n, and what the guarantee assumes. It never shows a validation metric: a tuned release's
would reveal the validation rows' count and accuracy, which its guarantee does not cover.
It names no candidate, no candidate version, record, lineage or metric, no weight and no
bound's assumption text (which names release units): those are on the internal card
(:mod:`dpmerge.privacy_card`), kept in the release-state store (docs/design.md#release-state,
docs/design.md#row-protection). Like the internal card it computes no ε; displayed ε values are
rounded up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dpmerge.accounting.private_accuracy import PRIVACY_KEYS
from dpmerge.accounting.private_selection import METRIC_KEYS as SELECTION_KEYS
from dpmerge.privacy_card import (
    BOUND_LABELS,
    LEDGER_NOTE,
    METHODS,
    PrivacyCard,
    accuracy_value,
    assumption_lines,
    assumptions_section,
    attempts_lines,
    bound_rows,
    headline,
    ledger_line,
    library_versions,
    row_protection,
    rows_data,
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
LEDGER_KEYS = (
    *("epsilon", "delta", "accountant", "cap", "releases", "as_of"),
    *("test_epsilon", "test_composition", "person_epsilon", "person_composition"),
)
"""The ledger fields a public card shows; of ``test_unrecorded`` (release ids), the count."""
ACCURACY_KEYS = ("test_accuracy",)
"""The accuracy a public card shows: the test split's only (see the module docstring)."""
PUBLIC_METRICS = (
    *ACCURACY_KEYS,
    *PRIVACY_KEYS,
    "test_n",
    *(f"selection_{key}" for key in SELECTION_KEYS),
)
"""The metrics a public card reads: the test accuracy and, where it is a private estimate, its
guarantee and n_test (public), and a private selection's guarantee on the validation rows."""
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
    delta_warning: str | None = None,
) -> PrivacyCard:
    """The public card of the release ``report`` (a ``PrivacyReport.to_dict()``) describes;
    ``metrics`` are the released model's (only its test accuracy is shown), ``ledger`` the
    cumulative bound with it counted (``as_of``: when), ``tuned``: its weights were tuned on
    validation accuracy; ``notes`` (e.g. why it spends less than the target) must follow from
    the records and the target alone; ``delta_warning``: :attr:`DeltaCheck.warning
    <dpmerge.accounting.delta.DeltaCheck.warning>` for the release's δ and n."""
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
    public_metrics = {k: metrics[k] for k in PUBLIC_METRICS if k in metrics}
    rows = row_protection(report, public_metrics, tuned)
    weak = [f"**Weak δ** — {delta_warning.removeprefix('warning: ')}.", ""] if delta_warning else []
    md = [
        *head.markdown,
        *weak,
        *attempts_lines(ledger or {}, listed=False),
        *utility_lines(public_metrics),
        *rows_section(rows),
        *assumptions_section(report),
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
        public_ledger["test_unrecorded"] = len(ledger.get("test_unrecorded") or ())
        details = [str(ledger.get("accountant")).upper(), f"{ledger.get('releases')} release(s)"]
        if ledger.get("cap") is not None:
            details.append(f"cap ε = {ledger['cap']:g}")
        md += ["## Release ledger (cumulative)", "", ledger_line(ledger, details), ""]
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
        "delta_warning": delta_warning,
        "assumptions": assumption_lines(report),
        "rows": rows_data(rows),
        "notes": notes,
        "libraries": versions,
    }
    return PrivacyCard("\n".join(md), data)
