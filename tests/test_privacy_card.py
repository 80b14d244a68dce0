"""The privacy card shows the report's numbers (it computes none) and never the RS draw."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest
from factories import laplace_delta, make_record

from dpmerge.accounting.account import account
from dpmerge.accounting.calibration import calibrate
from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.delta import delta_check_for
from dpmerge.accounting.private_accuracy import private_accuracy
from dpmerge.accounting.records import MechanismRecord
from dpmerge.data import load_dataset
from dpmerge.data.datasets import DIGITS_TEST_FRACTION
from dpmerge.errors import RecordError
from dpmerge.formatting import epsilon_text, within_text
from dpmerge.privacy_card import (
    ASSUMPTIONS,
    INTERNAL_NOTE,
    LEDGER_COMMAND,
    STRUCTURED_LABEL,
    CardCandidate,
    PrivacyCard,
    build_privacy_card,
)
from dpmerge.public_card import build_public_card

DELTA = 1e-5


def record(name: str, sigma: float) -> MechanismRecord:
    return make_record(
        name,
        sigma,
        steps=100,
        sample_rate=0.01,
        learning_rate=0.5,
        batch=100.0,
        dataset="toy-sha256:0123456789abcdef",
        dataset_size=10_000,
        initialisation="zeros",
    )


RECORDS = [record("cand-a", 1.0), record("cand-b", 1.5), record("cand-c", 2.0)]


def entries() -> list[CardCandidate]:
    return [
        CardCandidate.from_record(r, candidate_bound(r, DELTA).to_dict(), str(i + 1))
        for i, r in enumerate(RECORDS)
    ]


def bound(kind: str, pld: float | None, rdp: float | None, **extra: Any) -> dict[str, Any]:
    values = [v for v in (pld, rdp) if v is not None]
    return {
        "kind": kind,
        "delta": DELTA,
        "epsilon_pld": pld,
        "epsilon_rdp": rdp,
        "rdp_order": 8.0,
        "discretisation": 1e-4,
        "assumptions": extra.pop("assumptions", []),
        "reason": extra.pop("reason", None),
        "neighbouring": "add_or_remove_one",
        "epsilon": min(values) if values else None,
        "accountant": ("pld" if pld is not None and (rdp is None or pld <= rdp) else "rdp")
        if values
        else None,
        "description": f"{kind} bound",
    }


def fabricated_lc_report(structured: dict[str, Any] | None) -> dict[str, Any]:
    """A report with made-up ε values: the card must show these, not recompute anything."""
    generic = bound("generic", 1.234561, 1.5)
    return {
        "method": "lc",
        "candidates": [r.name for r in RECORDS],
        "weights": [0.5, 0.3, 0.2],
        "delta": DELTA,
        "bound": "generic",
        "epsilon": 1.234561,
        "accountant": "pld",
        "epsilon_pld": 1.234561,
        "epsilon_rdp": 1.5,
        "neighbouring": "add_or_remove_one",
        "assumptions": [],
        "notes": ["a note from the accountant"],
        "bounds": {"gating": generic, "generic": generic, "structured": structured},
    }


def test_card_shows_the_reports_numbers_rounded_up() -> None:
    structured = bound("structured", 0.987654, None, assumptions=["plain SGD"])
    card = build_privacy_card(
        fabricated_lc_report(structured),
        target_epsilon=2.0,
        target_delta=DELTA,
        candidates=entries(),
        model_name="dpmerge-toy-logreg-releases",
        policy_id="policy-7",
        metrics={"test_accuracy": 0.81234, "validation_accuracy": 0.8, "test_loss": 0.4},
        notes=["spends less: the utility peaks here"],
    )
    md = card.markdown
    assert "ε = 1.2346" in md  # 1.234561 rounded up, never down
    assert "0.9877" in md and STRUCTURED_LABEL in md and "plain SGD" in md
    assert "Generic" not in md.split("### Gating")[0]  # generic is the gate here, shown once
    assert "(2, 1e-05) of policy `policy-7`, which first asked for this release: met" in md
    assert "a note from the accountant" in md and INTERNAL_NOTE in md
    assert "**Accuracy** of this model: test 0.8123, validation 0.8000." in md
    assert "- spends less: the utility peaks here" in md
    for r in RECORDS:
        assert f"| {r.name} |" in md and r.noise_lineage in md
    for library in ("dpmerge", "dp-accounting", "opacus", "torch", "mlflow"):
        assert library in md and library in card.data["libraries"]
    data = json.loads(card.to_json())
    assert data["guarantee"]["epsilon"] == 1.234561  # unrounded in JSON
    assert data["bounds"]["structured"]["epsilon_pld"] == 0.987654
    assert data["merge"]["weights"] == [0.5, 0.3, 0.2]
    assert data["accuracy"] == {"test_accuracy": 0.81234, "validation_accuracy": 0.8}
    assert [c["version"] for c in data["merge"]["candidates"]] == ["1", "2", "3"]


def test_unavailable_structured_bound_shows_its_reason() -> None:
    structured = bound("structured", None, None, reason="candidates share noise lineage")
    card = build_privacy_card(
        fabricated_lc_report(structured),
        target_epsilon=1.0,
        target_delta=DELTA,
        candidates=entries(),
    )
    assert "Not available: candidates share noise lineage." in card.markdown
    assert "**not met**" in card.markdown and card.data["target"]["met"] is False


def test_real_lc_report_with_structured_gate_shows_generic_beside_it() -> None:
    report = account(RECORDS, "lc", [0.2, 0.3, 0.5], DELTA, gating_bound="structured").to_dict()
    card = build_privacy_card(report, target_epsilon=5.0, target_delta=DELTA, candidates=entries())
    md = card.markdown
    assert f"Gating bound: {STRUCTURED_LABEL}" in md
    assert "Generic bound" in md and epsilon_text(report["bounds"]["generic"]["epsilon"]) in md
    assert epsilon_text(report["epsilon"]) in md


def test_rs_card_names_probabilities_but_no_draw() -> None:
    report = account(RECORDS, "rs", [0.25, 0.25, 0.5], DELTA).to_dict()
    card = build_privacy_card(report, target_epsilon=5.0, target_delta=DELTA, candidates=entries())
    text = card.markdown + card.to_json()
    assert "π (selection probability)" in card.markdown
    assert "not recorded here" in card.markdown
    for word in ("drawn_index", "drawn_candidate", "selected", "released candidate"):
        assert word not in text
    # every candidate is named equally often: nothing singles one out
    counts = {r.name: text.count(r.name) for r in RECORDS}
    assert len(set(counts.values())) == 1, counts


def test_ledger_section() -> None:
    """The ledger line states the training rows' bound, the test rows' (δ = 0, how composed)
    and one person's, with the rule that composes it; unbounded test rows read so, in bold."""
    ledger = {"epsilon": 3.21, "delta": DELTA, "accountant": "pld", "cap": 8.0, "releases": 3}
    ledger |= {"test_epsilon": 1.5, "test_composition": "sequential", "test_unrecorded": []}
    ledger |= {"person_epsilon": 3.21, "person_composition": "parallel"}

    def card(ledger: dict[str, Any]) -> str:
        return build_privacy_card(
            fabricated_lc_report(None),
            target_epsilon=2.0,
            target_delta=DELTA,
            candidates=entries(),
            ledger=ledger,
        ).markdown

    md = card(ledger)
    assert "## Release ledger (cumulative)" in md
    assert "training rows ε = **3.2100** at δ = 1e-05 (PLD; cap ε = 8; 3 releases)." in md
    assert "Test rows: ε = **1.5000** at δ = 0 (the releases' accuracy estimates' ε summed" in md
    assert "One person, whichever split holds their row: ε = **3.2100** at δ = 1e-05" in md
    assert "the largest of the splits': every release used one dataset identifier" in md
    summed = card(ledger | {"person_epsilon": 4.71, "person_composition": "sequential"})
    assert "ε = **4.7100** at δ = 1e-05 (their sum: releases used several dataset" in summed
    old = card(ledger | {"test_epsilon": None, "test_unrecorded": ["r1", "r2"]})
    assert "Test rows: **not bounded** — 2 release(s) have no recorded DP estimate" in old
    assert "whichever split holds their row: **not bounded**" in old


def test_description_fits_mlflow_limit() -> None:
    card = build_privacy_card(
        fabricated_lc_report(None), target_epsilon=2.0, target_delta=DELTA, candidates=entries()
    )
    assert card.description() == card.markdown
    short = card.description(limit=len(card.markdown) - 1)
    assert len(short) < len(card.markdown) and "Full card" in short and "## Bounds" in short


def test_candidates_must_match_the_report() -> None:
    with pytest.raises(RecordError, match="differ from the report"):
        build_privacy_card(
            fabricated_lc_report(None),
            target_epsilon=2.0,
            target_delta=DELTA,
            candidates=entries()[:2],
        )
    with pytest.raises(RecordError, match=r"PrivacyReport\.to_dict"):
        build_privacy_card(
            {"method": "lc"}, target_epsilon=2.0, target_delta=DELTA, candidates=entries()
        )


def test_eps_text_rounds_up() -> None:
    assert epsilon_text(1.00001) == "1.0001"
    assert epsilon_text(2.0) == "2.0000"
    assert epsilon_text(None) == "—"


def test_within_text_keeps_the_shown_relation() -> None:
    assert within_text(1.2116070678845434, 1.153912649717764 * 1.05) == (
        "ε = 1.211608 ≤ ε* = 1.211608"
    )
    assert within_text(1.98341, 2.0) == "ε = 1.9835 ≤ ε* = 2"
    # calibrated just under a target the float cannot hold exactly: four places, as the others
    assert within_text(1.1999987, 1.2) == "ε = 1.2000 ≤ ε* = 1.2"
    assert within_text(2.0, 2.0) == "ε = 2.0000 ≤ ε* = 2"
    assert within_text(2.5, 2.0) == "ε = 2.5000 > ε* = 2"  # never shown as within


def test_a_mixture_card_shows_both_merges_their_odds_and_the_mixture_bound():
    """Both rungs (members, λ within each, odds, each rung's generic ε) and the mixture ε under
    PLD and RDP, every number read from the report and displayed rounded up; the draw is not
    named."""
    from dpmerge.accounting.mixture import mixture_report

    report = mixture_report(
        RECORDS, [(0.7, (0.0, 0.36, 0.64)), (0.3, (0.5, 0.0, 0.5))], DELTA
    ).to_dict()
    card = build_privacy_card(
        report, target_epsilon=5.0, target_delta=DELTA, candidates=entries(), policy_id="eu"
    )
    md = card.markdown
    assert "mixture — a secret draw between LC merges" in md
    assert "gated by the **mixture (of the LC merges' generic-bound curves)** bound" in md
    gating = report["bounds"]["gating"]
    pld_row = "| PLD (dp_accounting, connect-the-dots, pessimistic) |"
    assert f"{pld_row} {epsilon_text(gating['epsilon_pld'])} |" in md
    assert f"| RDP (converted to (ε, δ)) | {epsilon_text(gating['epsilon_rdp'])} |" in md
    for j, rung in enumerate(report["rungs"]):
        line = next(x for x in md.splitlines() if x.startswith(f"| {j + 1} | "))
        assert f"| {rung['probability']:.4f} | {', '.join(rung['members'])} |" in line
        assert (
            epsilon_text(rung["epsilon_pld"]) in line and epsilon_text(rung["epsilon_rdp"]) in line
        )
    assert "| cand-a | 1 | 0.0000 | 0.5000 |" in md and "| cand-b | 2 | 0.3600 | 0.0000 |" in md
    assert "not recorded here" in md and "drawn" not in json.dumps(card.data["merge"])
    assert card.data["merge"]["weights"] is None and len(card.data["merge"]["rungs"]) == 2
    assert card.data["guarantee"]["bound"] == "mixture" and card.data["target"]["met"]
    broken = {**report, "rungs": []}
    with pytest.raises(RecordError, match="lacks its rungs"):
        build_privacy_card(broken, target_epsilon=5.0, target_delta=DELTA, candidates=entries())


def public_card(
    report: dict[str, Any], ledger: dict[str, Any] | None, metrics: dict[str, Any], tuned: bool
) -> PrivacyCard:
    """The public card of ``report`` for policy ``p``'s target (ε*, δ*) = (7, DELTA)."""
    return build_public_card(
        report,
        target_epsilon=7.0,
        target_delta=DELTA,
        model_name="m",
        policy_id="p",
        ledger=ledger,
        metrics=metrics,
        tuned=tuned,
    )


@pytest.mark.parametrize("method", ["lc", "rs", "mixture"])
def test_the_public_card_names_no_candidate_and_states_each_split_protection(method: str) -> None:
    """The public card holds the guarantee, the bounds' values and counts; no candidate name,
    record, lineage, weight or assumption text (those name release units); and it states how the
    training, validation and test rows are protected (docs/design.md#row-protection)."""
    if method == "mixture":
        report = calibrate(RECORDS, "mixture", 6.0, DELTA).report.to_dict()
    else:
        weights = [0.2, 0.3, 0.5]
        report = account(RECORDS, method, weights, DELTA).to_dict()
    ledger = {"epsilon": 9.5, "delta": DELTA, "accountant": "pld", "cap": None, "releases": 2}
    ledger |= {"candidates": [r.name for r in RECORDS], "attempts": [{"release": "f" * 64}]}
    for tuned in (False, True):
        card = public_card(report, ledger, {"test_accuracy": 0.8125}, tuned)
        text = card.markdown + card.to_json()
        for secret in (
            *(r.name for r in RECORDS),
            *(r.noise_lineage for r in RECORDS),
            "noise_multiplier",
            "0.3000",
            "f" * 12,
        ):
            assert secret not in text, secret
        assert (
            card.data["audience"] == "public"
            and card.data["guarantee"]["epsilon"] == (report["epsilon"])
        )
        assert card.data["merge"]["candidates"] == len(report["used_candidates"])
        assert card.data["ledger"]["attempts"] == 1 and "0.8125" in card.markdown
        rows = card.data["rows"]
        assert not rows["test"]["protected"]  # an exact accuracy: its rows are not protected
        assert rows["test"]["text"].startswith("**not protected**")
        assert rows["validation"]["protected"] != tuned
        assert rows["validation"]["text"].startswith("**not protected**") == tuned
        assert rows["training"]["epsilon"] == report["epsilon"]
        assert f"| training | protected: ε = {epsilon_text(report['epsilon'])}" in card.markdown
    internal = build_privacy_card(
        report, target_epsilon=7.0, target_delta=DELTA, candidates=entries(), ledger=ledger
    )
    assert all(r.name in internal.markdown for r in RECORDS)  # the internal card names them


def test_the_public_card_warns_of_a_weak_delta_states_its_assumptions_and_dates_the_ledger():
    """The weak-δ warning derived from the records' n, what the guarantee assumes (the split as
    dpmerge.data really makes it), the ledger line with its time and the command that reads it
    now; and no validation metric, whose value and count would reveal rows a tuned release does
    not protect."""
    defaults = inspect.signature(load_dataset).parameters
    seed, fraction = defaults["seed"].default, defaults["validation_fraction"].default
    split = next(a for a in ASSUMPTIONS if a.startswith("The split"))
    assert f"fixed public seed {seed}," in split and f"are {fraction * 100:g} % of" in split
    assert f"digits: a fixed {DIGITS_TEST_FRACTION * 100:g} %" in split
    ledger = {"epsilon": 2.5, "delta": 5e-5, "accountant": "pld", "cap": None, "releases": 8}
    ledger["as_of"] = "2026-12-05T08:00:00+00:00"
    ledger |= {"test_epsilon": 1.0, "test_composition": "sequential", "test_unrecorded": []}
    ledger |= {"person_epsilon": 2.5, "person_composition": "parallel"}
    for delta in (5e-5, DELTA):
        report = account(RECORDS, "lc", [0.2, 0.3, 0.5], delta).to_dict()
        warning = delta_check_for(RECORDS, delta).warning
        card = build_public_card(
            report,
            target_epsilon=7.0,
            target_delta=delta,
            model_name="m",
            policy_id="p",
            ledger=ledger,
            metrics={"test_accuracy": 0.8125, "validation_accuracy": 0.7771, "validation_n": 1234},
            tuned=True,
            delta_warning=warning,
        )
        md, data = card.markdown, card.data
        assert (warning is None) == (delta == DELTA)  # n = 10,000: 1e-5 is 1/(10·n) exactly
        assert ("**Weak δ**" in md) == (warning is not None) and data["delta_warning"] == warning
        if warning is not None:
            assert f"**Weak δ** — {warning.removeprefix('warning: ')}" in md
            assert "n = 10,000 training rows" in md
        assert "## What the guarantee assumes" in md
        assert data["assumptions"][: len(ASSUMPTIONS)] == list(ASSUMPTIONS)
        assert all(f"- {a}" in md for a in data["assumptions"])
        gate = data["assumptions"][-1]
        assert "the generic bound" in gate and report["accountant"].upper() in gate
        assert "as of 2026-12-05T08:00:00+00:00: training rows ε = **2.5000**" in md
        assert "Test rows: ε = **1.0000** at δ = 0" in md and "ε = **2.5000** at δ = 5e-05 (" in md
        assert data["ledger"]["test_epsilon"] == 1.0 and data["ledger"]["test_unrecorded"] == 0
        assert data["ledger"]["person_composition"] == "parallel"
        assert f"`{LEDGER_COMMAND}` shows it now" in md and LEDGER_COMMAND == "dpmerge ledger show"
        assert data["ledger"]["as_of"] == ledger["as_of"]
        text = md + card.to_json()
        assert "0.7771" not in text and "1234" not in text and "1,234" not in text
        assert data["accuracy"] == {"test_accuracy": 0.8125}


def test_every_row_reads_protected_on_the_default_cards_with_its_epsilon() -> None:
    """The public card of a release with a private test estimate: training rows at the
    release's ε, validation rows unused (ε 0), test rows at the estimate's ε (re-derived with
    dp_accounting); under ``tune_weights`` the validation rows read not protected."""
    report = account(RECORDS, "lc", [0.2, 0.3, 0.5], DELTA).to_dict()
    estimate = private_accuracy(0.8, 360, 0.5)
    for tuned in (False, True):
        card = public_card(report, None, {**estimate.metrics(), "test_loss": 0.123456}, tuned)
        rows, md = card.data["rows"], card.markdown
        assert rows["training"]["protected"] and rows["training"]["epsilon"] == report["epsilon"]
        assert rows["training"]["delta"] == report["delta"]
        assert rows["validation"]["protected"] != tuned
        assert rows["test"]["protected"] and rows["test"]["delta"] == 0.0
        assert laplace_delta(estimate, rows["test"]["epsilon"]) <= 1e-12
        assert f"| test | protected: ε = {epsilon_text(0.5)}, δ = 0 (Laplace" in md
        assert f"test {estimate.value:.4f} (test: an ε = {epsilon_text(0.5)} differentially" in md
        assert "0.123456" not in md + card.to_json()  # only the estimate is shown
        assert all(r["protected"] for r in rows.values()) != tuned
