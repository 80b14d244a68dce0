"""The internal privacy card of a released (merged) model: Markdown for people, JSON for tools.

This card names the candidates, their records and the merge weights: it is kept in the
release-state store for the workflow and operators (``dpmerge registry show --internal``), never
published; what a consumer reads is its public counterpart, :mod:`dpmerge.public_card`
(docs/design.md#release-state).

The card states the target (ε*, δ*), the bound that gates promotion with its ε under PLD and
RDP (accountant, δ, neighbouring relation, discretisation), the generic bound always and the
structured one beside it where present, the merge method and weights, the candidates, the
cumulative release-ledger bound when given, and library versions (docs/design.md#mechanism-record,
docs/design.md#generic-bound, docs/design.md#release-ledger).

It **computes no ε**: every number comes from the report dict (``PrivacyReport.to_dict()``)
and the candidate entries passed in. Displayed ε values are rounded *up* (they are upper
bounds); the JSON carries them unrounded. For RS the card names the probabilities π but never
the drawn candidate, which it is never given (docs/design.md#random-selection).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

from dpmerge.accounting.private_accuracy import PrivateAccuracy
from dpmerge.accounting.private_selection import Selection
from dpmerge.accounting.records import Candidate, MechanismRecord
from dpmerge.errors import RecordError
from dpmerge.formatting import epsilon_text
from dpmerge.vocabulary import Composition

CARD_SCHEMA = "dpmerge.privacy_card/1"
LIBRARIES = ("dpmerge", "dp-accounting", "opacus", "torch", "mlflow")
STRUCTURED_LABEL = "structured (the DP model merging paper's analysis)"
INTERNAL_NOTE = (
    "Candidate weights, and anything computed from them such as their accuracies, are internal: "
    "publishing them voids this guarantee, which covers this released model only."
)
RS_NOTE = (
    "Random selection released one candidate drawn secretly with the probabilities above; which "
    "one is part of the mechanism's randomness and is not recorded here "
    "(docs/design.md#rs-secrecy)."
)
MIXTURE_NOTE = (
    "A secret draw released one of the LC merges above with the odds shown; which one is part "
    "of the mechanism's randomness and is not recorded here (docs/design.md#rs-secrecy). The "
    "guarantee is the mixture of the merges' generic bounds; the release ledger counts every "
    "candidate of either merge."
)
LEDGER_NOTE = (
    "Releases derived from the same candidates are correlated: adding up their ε values is not "
    "a valid bound; the cumulative bound is the joint release of every candidate used "
    "(docs/design.md#release-ledger)."
)
BOUND_LABELS = {
    "generic": "generic (composition of the used candidates; no assumption)",
    "structured": STRUCTURED_LABEL,
    "selection": "selection (mixture of the candidates' privacy curves)",
    "mixture": "mixture (of the LC merges' generic-bound curves)",
    "gaussian": "Gaussian mechanism (exact)",
    "candidate": "candidate (its own DP-SGD accounting)",
}
METHODS = {
    "rs": "RS — random selection",
    "lc": "LC — linear combination θ = Σ λ_i θ_i",
    "mixture": "mixture — a secret draw between LC merges θ = Σ λ_i θ_i of two subsets",
}


@dataclass(frozen=True)
class CardCandidate:
    """One candidate as the card lists it: its registry version and its own bound."""

    name: str
    version: str | None
    epsilon: float | None
    accountant: str | None
    delta: float | None
    noise_multiplier: float | None = None
    sample_rate: float | None = None
    steps: int | None = None
    noise_lineage: str | None = None
    batch_lineage: str | None = None

    @classmethod
    def from_record(
        cls, candidate: Candidate, privacy: Mapping[str, Any] | None, version: str | None
    ) -> CardCandidate:
        """From a mechanism record (or label) and its stored candidate bound dict."""
        bound = dict(privacy or {})
        record = candidate if isinstance(candidate, MechanismRecord) else None
        label_eps = getattr(candidate, "epsilon", None)
        return cls(
            name=candidate.name,
            version=version,
            epsilon=bound.get("epsilon", label_eps),
            accountant=bound.get("accountant", "label" if label_eps is not None else None),
            delta=bound.get("delta", getattr(candidate, "delta", None)),
            noise_multiplier=record.noise_multiplier if record else None,
            sample_rate=record.sample_rate if record else None,
            steps=record.steps if record else None,
            noise_lineage=record.noise_lineage if record else None,
            batch_lineage=record.batch_lineage if record else None,
        )


CARD_MARKDOWN, CARD_JSON = "privacy_card.md", "privacy_card.json"
"""A card's files, in a release's run and in its model's ``extra_files/``."""


@dataclass(frozen=True)
class PrivacyCard:
    markdown: str
    data: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps(self.data, indent=2, sort_keys=True)

    def description(self, limit: int = 5000) -> str:
        """The Markdown, or its headline and bounds when longer than ``limit`` characters
        (an MLflow model-version description holds 5000)."""
        if len(self.markdown) <= limit:
            return self.markdown
        head = self.markdown.split("\n## Merge", 1)[0]
        short = head + "\n\nFull card: artifact `privacy_card.md`.\n"
        return short if len(short) <= limit else short[: limit - 1] + "…"


def library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def num(value: Any) -> str:
    return "—" if value is None else f"{value:g}"


def require_report(report: Mapping[str, Any]) -> Mapping[str, Any]:
    missing = [
        k
        for k in ("method", "candidates", "weights", "delta", "bound", "epsilon", "bounds")
        if k not in report
    ]
    if missing or "gating" not in report.get("bounds", {}):
        raise RecordError(
            f"privacy report lacks {', '.join(missing) or 'bounds.gating'}; "
            "pass PrivacyReport.to_dict()"
        )
    if report["method"] not in METHODS:
        raise RecordError(f"privacy report has unknown method {report['method']!r}")
    return report["bounds"]["gating"]


def bound_rows(bound: Mapping[str, Any]) -> list[str]:
    delta = num(bound.get("delta"))
    pld, rdp = epsilon_text(bound.get("epsilon_pld")), epsilon_text(bound.get("epsilon_rdp"))
    return [
        f"| PLD (dp_accounting, connect-the-dots, pessimistic) | {pld} | {delta} "
        f"| value discretisation {num(bound.get('discretisation'))} |",
        f"| RDP (converted to (ε, δ)) | {rdp} | {delta} "
        f"| best order α = {num(bound.get('rdp_order'))} |",
    ]


def attempts_lines(ledger: Mapping[str, Any], *, listed: bool = True) -> list[str]:
    """Earlier releases evaluated for the same policy and never served: releasing this one
    after them is a selection among them (docs/design.md#release-state). ``listed``: name
    each (the internal card), else only their number (the public card)."""
    attempts = ledger.get("attempts") or []
    if not attempts:
        return []
    which = "; ".join(
        f"release {a.get('release', '')[:12]}… ({a.get('method')}, policy version "
        f"{a.get('policy_version')}, counted {a.get('counted_at')})"
        for a in attempts
    )
    return [
        f"**Earlier attempts for this policy:** {len(attempts)} release(s) were evaluated "
        f"(and counted) but not served before this one{f': {which}' if listed else ''}. "
        "Releasing this one after "
        "them is a selection among them: the guarantee above covers this release alone; the "
        "release ledger's cumulative bound covers all of them together.",
        "",
    ]


def _ledger_section(ledger: Mapping[str, Any]) -> list[str]:
    details = []
    if ledger.get("accountant"):
        details.append(str(ledger["accountant"]).upper())
    if ledger.get("cap") is not None:
        details.append(f"cap ε = {ledger['cap']:g}")
    if ledger.get("releases"):
        count = ledger["releases"]
        details.append(f"{count} release" + ("" if count == 1 else "s"))
    lines = ["## Release ledger (cumulative)", "", ledger_line(ledger, details), ""]
    if ledger.get("candidates"):
        lines += [f"Candidates used by any release: {', '.join(ledger['candidates'])}.", ""]
    return lines


ACCURACY_KEYS = ("test_accuracy", "validation_accuracy")
LEDGER_COMMAND = "dpmerge ledger show"
"""The command that shows a ledger's cumulative bound now (operators: it reads the state
store); a card's ledger line is the bound as of the time it states."""
ASSUMPTIONS = (
    "Poisson sampling: each DP-SGD step included every training row independently with "
    "probability q, as the accountants assume.",
    "n is public: the number of training rows, and the rate, steps and batch size set from it, "
    "are not protected; so is the number of test rows, which sets the scale of the test "
    "accuracy's noise.",
    "The split: validation rows are 10 % of the training file (after any row limit), picked by "
    "a permutation with the fixed public seed 0, not a secret key; test rows are the separate "
    "test file (digits: a fixed 20 %). Candidates with other row limits may train on rows "
    "another held out.",
    "Floating-point noise: the analysis assumes exact Gaussian noise; it is sampled in "
    "floating point.",
)


def assumption_lines(report: Mapping[str, Any]) -> list[str]:
    """What the guarantee rests on (imported candidates' attestations in bold, then
    :data:`ASSUMPTIONS`) and which bound gates promotion (docs/design.md#operator-trust,
    docs/design.md#imported-candidates)."""
    return [
        *(f"**{line}**" for line in report.get("attestations", ())),
        *ASSUMPTIONS,
        f"Promotion is gated by the {report['bound']} bound's ε "
        f"({str(report.get('accountant')).upper()}) at δ = {num(report.get('delta'))}, within "
        "the target ε*.",
    ]


def assumptions_section(report: Mapping[str, Any]) -> list[str]:
    return [
        "## What the guarantee assumes",
        "",
        *(f"- {line}" for line in assumption_lines(report)),
        "",
    ]


def ledger_line(ledger: Mapping[str, Any], details: Sequence[str]) -> str:
    """The cumulative bound per split and per person, dated, and where to read it now
    (docs/design.md#release-ledger)."""
    as_of = f" as of {ledger['as_of']}" if ledger.get("as_of") else ""
    training = (
        f"All releases from this data source together (every subset){as_of}: training rows "
        f"ε = **{epsilon_text(ledger.get('epsilon'))}** at δ = {num(ledger.get('delta'))}"
        + (f" ({'; '.join(details)})" if details else "")
        + "."
    )
    later = f"Later releases raise it: `{LEDGER_COMMAND}` shows it now."
    return " ".join([training, *split_statements(ledger), later])


PERSON_RULES = {
    Composition.PARALLEL.value: "the largest of the splits': every release used one dataset "
    "identifier, so a person is a training, a validation or a test row, never two",
    Composition.SEQUENTIAL.value: "their sum: releases used several dataset identifiers "
    "(subsets), whose test rows are not known to be apart from another's training rows",
}


def split_statements(ledger: Mapping[str, Any]) -> list[str]:
    """The test rows', the validation rows' (where a private selection spent on them) and one
    person's sentences of a ledger statement (none where it predates them:
    ``test_composition`` absent)."""
    if "test_composition" not in ledger:
        return []
    unrecorded = ledger.get("test_unrecorded") or ()
    count = unrecorded if isinstance(unrecorded, int) else len(unrecorded)
    if ledger.get("test_epsilon") is None:
        test = (
            f"Test rows: **not bounded** — {count} release(s) have no recorded DP estimate of "
            "their accuracy (counted before the ledger recorded it; they may have published an "
            "exact one)."
        )
        person = "One person, whichever split holds their row: **not bounded** (test rows)."
    else:
        test = (
            f"Test rows: ε = **{epsilon_text(ledger['test_epsilon'])}** at δ = 0 (the "
            "releases' accuracy estimates' ε summed: basic composition of pure ε)."
        )
        rule = PERSON_RULES.get(str(ledger.get("person_composition")), "")
        person = (
            f"One person, whichever split holds their row: ε = "
            f"**{epsilon_text(ledger.get('person_epsilon'))}** at δ = {num(ledger.get('delta'))} "
            f"({rule})."
        )
    validation = ledger.get("validation_epsilon") or 0.0
    if not validation:
        return [test, person]
    selections = (
        f"Validation rows: ε = **{epsilon_text(validation)}** at δ = 0 (the releases' private "
        "selections' ε summed: basic composition of pure ε)."
    )
    return [test, selections, person]


@dataclass(frozen=True)
class RowProtection:
    """How a release protects one split's rows: ``epsilon`` and ``delta`` where it does
    (0 for rows it does not use), ``text`` for the card (docs/design.md#row-protection)."""

    protected: bool
    epsilon: float | None
    delta: float | None
    text: str


NOT_PROTECTED = "**not protected**"
VALIDATION_UNUSED = (
    "not used by this release (its weights are fixed from the mechanism records alone)"
)
VALIDATION_TUNED = (
    "the merge weights were tuned on their accuracy (the policy opted into `tune_weights`)"
)
TEST_EXACT = "a test accuracy on this card is exact, computed on them, and gates promotion"


def test_protection(estimate: PrivateAccuracy | None) -> RowProtection:
    """The test rows' protection: the estimate's ε when the card's accuracy is one."""
    if estimate is None:
        return RowProtection(False, None, None, f"{NOT_PROTECTED}: {TEST_EXACT}")
    text = (
        f"protected: ε = {epsilon_text(estimate.epsilon)}, δ = {num(estimate.delta)} "
        f"({estimate.mechanism.value.capitalize()} mechanism, sensitivity 1/n_test, "
        f"n_test = {estimate.n}): the test accuracy on this card is this differentially "
        "private estimate, and promotion is gated on it; each release's estimate spends its own "
        "ε on the same test rows, and the release ledger states their sum"
    )
    return RowProtection(True, estimate.epsilon, estimate.delta, text)


def validation_protection(selection: Selection | None, tuned: bool) -> RowProtection:
    """The validation rows' protection: not protected where ``tuned`` (the opt-out), the
    private selection's ε where ``selection`` (private tuning), else unused (ε = 0)."""
    if tuned:
        return RowProtection(False, None, None, f"{NOT_PROTECTED}: {VALIDATION_TUNED}")
    if selection is None:
        return RowProtection(True, 0.0, 0.0, f"protected: {VALIDATION_UNUSED}")
    text = (
        f"protected: ε = {epsilon_text(selection.epsilon)}, δ = {num(selection.delta)} "
        f"(private tuning: the {selection.mechanism.value} mechanism chose this release among "
        f"{selection.options} merges on its count of correct predictions, sensitivity 1, "
        f"n_validation = {selection.n})"
    )
    return RowProtection(True, selection.epsilon, selection.delta, text)


def row_protection(
    report: Mapping[str, Any], metrics: Mapping[str, Any], tuned: bool
) -> dict[str, RowProtection]:
    """How the release ``report`` describes protects each split's rows
    (docs/design.md#row-protection): the training rows by its (ε, δ), the validation rows
    unused unless ``tuned`` (its LC weights were tuned on validation accuracy) or privately
    selected on (the selection ``metrics`` carry), the test rows by the private estimate
    ``metrics`` carry, if they carry one."""
    epsilon, delta = report["epsilon"], report["delta"]
    training = (
        f"protected: ε = {epsilon_text(epsilon)}, δ = {num(delta)} — the guarantee above: the "
        "candidates were trained on them with DP-SGD"
    )
    validation = validation_protection(Selection.from_metrics(metrics), tuned)
    return {
        "training": RowProtection(True, epsilon, delta, training),
        "validation": validation,
        "test": test_protection(PrivateAccuracy.from_metrics(metrics)),
    }


def rows_data(rows: Mapping[str, RowProtection]) -> dict[str, dict[str, Any]]:
    return {split: asdict(row) for split, row in rows.items()}


def rows_section(rows: Mapping[str, RowProtection]) -> list[str]:
    """The card's section on which private rows the guarantee covers."""
    return [
        "## Which rows the guarantee protects",
        "",
        "| rows | protection |",
        "|---|---|",
        *(f"| {split} | {row.text} |" for split, row in rows.items()),
        "",
    ]


def accuracy_value(metrics: Mapping[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def utility_lines(metrics: Mapping[str, Any]) -> list[str]:
    """The released model's accuracy (the only accuracy a card shows: candidates' are
    internal), said to be a private estimate where it is one."""
    values = {key.split("_")[0]: accuracy_value(metrics, key) for key in ACCURACY_KEYS}
    shown = [f"{split} {value:.4f}" for split, value in values.items() if value is not None]
    estimate = PrivateAccuracy.from_metrics(metrics)
    how = (
        f" (test: an ε = {epsilon_text(estimate.epsilon)} differentially private estimate, "
        f"{estimate.mechanism.value.capitalize()} noise on {estimate.n} test rows)"
        if estimate is not None and values["test"] is not None
        else ""
    )
    return [f"**Accuracy** of this model: {', '.join(shown)}{how}.", ""] if shown else []


def _bound_section(title: str, bound: Mapping[str, Any]) -> list[str]:
    lines = [f"### {title}", "", str(bound.get("description", "")), ""]
    if bound.get("epsilon") is None:
        return [*lines, f"Not available: {bound.get('reason') or 'no reason given'}.", ""]
    lines += [
        f"ε = **{epsilon_text(bound['epsilon'])}** ({str(bound.get('accountant')).upper()}), "
        f"δ = {num(bound.get('delta'))}, neighbouring relation: "
        f"{str(bound.get('neighbouring', '')).replace('_', '-')}.",
        "",
        "| accountant | ε | δ | setting |",
        "|---|---|---|---|",
        *bound_rows(bound),
        "",
    ]
    if bound.get("assumptions"):
        lines += ["Assumptions:", "", *(f"- {a}" for a in bound["assumptions"]), ""]
    return lines


def _rung_section(rungs: Sequence[Mapping[str, Any]]) -> list[str]:
    """A mixture's merges: odds, members and each merge's own generic bound (PLD and RDP)."""
    lines = [
        "| merge | probability | members | generic ε PLD | generic ε RDP | δ |",
        "|---|---|---|---|---|---|",
    ]
    for j, rung in enumerate(rungs):
        bound = rung.get("bound") or {}
        lines.append(
            f"| {j + 1} | {rung['probability']:.4f} | {', '.join(rung['members'])} "
            f"| {epsilon_text(rung.get('epsilon_pld'))} | {epsilon_text(rung.get('epsilon_rdp'))} "
            f"| {num(bound.get('delta'))} |"
        )
    return [*lines, ""]


@dataclass(frozen=True)
class Headline:
    """What both cards open with: the guarantee and the target, as Markdown and JSON."""

    markdown: list[str]
    data: dict[str, Any]


def headline(
    report: Mapping[str, Any],
    *,
    target_epsilon: float,
    target_delta: float,
    model_name: str | None,
    policy_id: str | None,
    audience: str,
) -> Headline:
    gating = require_report(report)
    epsilon, delta = report["epsilon"], report["delta"]
    meets = epsilon is not None and epsilon <= target_epsilon and delta <= target_delta
    neighbouring = str(report.get("neighbouring", gating.get("neighbouring", "")))
    markdown = [
        f"# Privacy card{f' — {model_name}' if model_name else ''}",
        "",
        f"**Guarantee:** (ε = {epsilon_text(epsilon)}, δ = {num(delta)})-DP under "
        f"{neighbouring.replace('_', '-')} adjacency, gated by the "
        f"**{BOUND_LABELS.get(report['bound'], report['bound'])}** bound "
        f"({str(report.get('accountant')).upper()} accountant).",
        "",
        f"**Target** (ε\\*, δ\\*) = ({target_epsilon:g}, {target_delta:g})"
        f"{f' of policy `{policy_id}`, which first asked for this release' if policy_id else ''}: "
        f"{'met' if meets else '**not met**'}.",
        "",
    ]
    data = {
        "schema": CARD_SCHEMA,
        "audience": audience,
        "model": model_name,
        "policy": policy_id,
        "target": {"epsilon": target_epsilon, "delta": target_delta, "met": meets},
        "guarantee": {
            "epsilon": epsilon,
            "delta": delta,
            "bound": report["bound"],
            "accountant": report.get("accountant"),
            "epsilon_pld": report.get("epsilon_pld"),
            "epsilon_rdp": report.get("epsilon_rdp"),
            "neighbouring": neighbouring,
        },
    }
    return Headline(markdown, data)


def software_section(versions: Mapping[str, str]) -> list[str]:
    return [
        "## Software",
        "",
        "| " + " | ".join(versions) + " |",
        "|" + "---|" * len(versions),
        "| " + " | ".join(versions.values()) + " |",
        "",
    ]


def build_privacy_card(
    report: Mapping[str, Any],
    *,
    target_epsilon: float,
    target_delta: float,
    candidates: Sequence[CardCandidate],
    model_name: str | None = None,
    policy_id: str | None = None,
    ledger: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    notes: Sequence[str] = (),
    tuned: bool = False,
) -> PrivacyCard:
    """The internal card of one merge (``tuned``: its LC weights were tuned on validation
    accuracy, see :func:`row_protection`). ``candidates`` must be exactly the report's candidates;
    ``metrics`` are the released model's (its ``test_accuracy`` and ``validation_accuracy`` are
    shown); ``notes`` are added to the report's (e.g. why the merge spends less than the
    target);
    ``ledger`` (optional) holds the cumulative release bound: ``epsilon``, ``delta`` and
    optionally ``accountant``, ``candidates``, ``releases``, ``cap`` and ``attempts`` (earlier
    releases evaluated for the same policy but never served) — e.g.
    ``dpmerge.policy_merge.LedgerSummary.card()``."""
    gating = require_report(report)
    by_name = {c.name: c for c in candidates}
    names = list(report["candidates"])
    if sorted(by_name) != sorted(names):
        raise RecordError(
            f"card candidates {sorted(by_name)} differ from the report's {sorted(names)}"
        )
    method = report["method"]
    rungs = list(report.get("rungs") or []) if method == "mixture" else []
    if method == "mixture" and not rungs:
        raise RecordError(
            "a mixture's privacy report lacks its rungs; pass PrivacyReport.to_dict()"
        )
    weights = None if rungs else list(report["weights"])
    bounds = report["bounds"]
    generic, structured = bounds.get("generic"), bounds.get("structured")
    versions = library_versions()
    columns = (
        [f"λ in merge {j + 1}" for j in range(len(rungs))]
        if rungs
        else ["π (selection probability)" if method == "rs" else "λ (weight)"]
    )

    head = headline(
        report,
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        model_name=model_name,
        policy_id=policy_id,
        audience="internal",
    )
    rows = row_protection(report, metrics or {}, tuned)
    md = [
        *head.markdown,
        *attempts_lines(ledger or {}),
        *utility_lines(metrics or {}),
        *rows_section(rows),
        *assumptions_section(report),
        "## Bounds",
        "",
        *_bound_section(
            f"Gating bound: {BOUND_LABELS.get(gating['kind'], gating['kind'])}", gating
        ),
    ]
    if method == "lc":
        if generic is not None and gating.get("kind") != "generic":
            md += _bound_section(f"Generic bound: {BOUND_LABELS['generic']}", generic)
        if generic is None:
            md += ["### Generic bound", "", "Missing from the report.", ""]
        if structured is not None and gating.get("kind") != "structured":
            md += _bound_section(f"Structured bound: {STRUCTURED_LABEL}", structured)
    elif method == "rs":
        md += [
            "The generic and structured bounds are LC bounds; random selection is bounded by the "
            "mixture of the candidates' curves (no independence between candidates needed).",
            "",
        ]
    else:
        md += [
            "Each merge drawn from is gated by its generic bound (its subset's release units "
            "composed, listed under Merge); the draw is bounded by the mixture of those curves "
            "(no independence between the merges needed). The structured bound is not used.",
            "",
        ]
    md += ["## Merge", "", f"Method: **{METHODS[method]}**.", ""]
    md += _rung_section(rungs) if rungs else []
    md += [
        f"| candidate | registry version | {' | '.join(columns)} | ε (accountant, δ) | σ | q | T "
        "| noise lineage | batch lineage |",
        "|---|---|" + "---|" * len(columns) + "---|---|---|---|---|---|",
    ]
    for index, name in enumerate(names):
        c = by_name[name]
        shares = [r["weights"][index] for r in rungs] if rungs else [weights[index]]  # type: ignore[index]
        md.append(
            f"| {c.name} | {c.version or '—'} | {' | '.join(f'{w:.4f}' for w in shares)} "
            f"| {epsilon_text(c.epsilon)} ({c.accountant or '—'}, {num(c.delta)}) "
            f"| {num(c.noise_multiplier)} | {num(c.sample_rate)} | {num(c.steps)} "
            f"| {c.noise_lineage or '—'} | {c.batch_lineage or '—'} |"
        )
    md.append("")
    md += _ledger_section(ledger) if ledger is not None else []
    drawn = {"rs": [RS_NOTE], "mixture": [MIXTURE_NOTE]}.get(method, [])
    notes = [*report.get("notes", []), *notes, *drawn]
    notes.append(INTERNAL_NOTE)
    notes += [LEDGER_NOTE] if ledger is not None else []
    md += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    md += software_section(versions)
    data = {
        **head.data,
        "bounds": {
            k: dict(v) for k, v in bounds.items() if k in ("gating", "generic", "structured") and v
        },
        "merge": {
            "method": method,
            "weights": None if rungs else weights,
            **({"rungs": rungs} if rungs else {}),
            "candidates": [asdict(by_name[n]) for n in names],
        },
        "ledger": dict(ledger) if ledger is not None else None,
        "accuracy": {k: accuracy_value(metrics or {}, k) for k in ACCURACY_KEYS},
        "rows": rows_data(rows),
        "assumptions": assumption_lines(report),
        "notes": notes,
        "libraries": versions,
    }
    return PrivacyCard("\n".join(md), data)
