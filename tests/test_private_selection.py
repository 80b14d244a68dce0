"""Private tuning's selection (docs/design.md#private-tuning): the exponential mechanism on
validation counts sampled as report-noisy-max with Gumbel noise, its ε re-derived on every
neighbour of small validation sets and with dp_accounting, the ledger's validation-row
statement, the policy fields' strict types, the options and their stated bound, and the kept
draw a rerun reuses."""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
from dp_accounting.pld import common, privacy_loss_distribution
from factories import make_record

from dpmerge.accounting.calibration import calibrate
from dpmerge.accounting.choice import choose_method
from dpmerge.accounting.ledger import release_of
from dpmerge.accounting.private_accuracy import Evaluation
from dpmerge.accounting.private_selection import (
    Selection,
    noisy_max,
    selection_probabilities,
)
from dpmerge.accounting.tuning import tuned_release, tuning_plan
from dpmerge.errors import IntegrityError, RecordError, RefusalError
from dpmerge.keys import WorkflowKey
from dpmerge.policies import PolicyError, policy_from_dict
from dpmerge.policy_merge.draws import selection_key, stored_selection
from dpmerge.state import CountedRelease, LocalBackend, StateStore, serving
from dpmerge.vocabulary import Composition, Method
from dpmerge.workspace import Workspace

DELTA = 1e-5
POLICY = {
    "name": "p",
    "target_epsilon": 2.0,
    "target_delta": DELTA,
    "dataset": "digits",
    "model": "logreg",
}


def test_draws_follow_the_exponential_mechanism() -> None:
    """With a fixed seed, 20,000 draws of report-noisy-max land on each option about as often
    as exp(ε·c_j/2)/Σ predicts (within 4 standard errors); a count far ahead always wins."""
    counts, epsilon = [10, 11, 13, 13], 1.0
    probabilities = selection_probabilities(counts, epsilon)
    weights = [math.exp(epsilon * c / 2) for c in counts]
    assert probabilities == pytest.approx([w / sum(weights) for w in weights], rel=1e-12)
    rng, draws = random.Random(7), 20_000
    seen = [0] * len(counts)
    for _ in range(draws):
        seen[noisy_max(counts, epsilon, rng)] += 1
    for p, k in zip(probabilities, seen, strict=True):
        assert abs(k / draws - p) <= 4 * math.sqrt(p * (1 - p) / draws)
    assert {noisy_max([0, 200, 3], 1.0, rng) for _ in range(200)} == {1}
    assert 0 <= noisy_max([5.0], 0.1) == 0  # the OS's generator when no seed is given


@pytest.mark.parametrize(
    ("counts", "epsilon"),
    [([], 1.0), ([1, -1], 1.0), ([1, True], 1.0), ([1], 0.0), ([1], math.inf), ([1], True)],
)
def test_bad_selection_inputs_are_refused(counts: list, epsilon: float) -> None:
    with pytest.raises(RecordError):
        noisy_max(counts, epsilon, random.Random(0))


def _max_log_ratio(a: list[float], b: list[float], epsilon: float) -> float:
    p, q = selection_probabilities(a, epsilon), selection_probabilities(b, epsilon)
    return max(abs(math.log(x) - math.log(y)) for x, y in zip(p, q, strict=True))


def test_epsilon_holds_on_every_neighbour_under_both_relations() -> None:
    """Every validation set of up to 4 rows over 3 options (each row: which options label it
    correctly): adding, removing or replacing one row moves the output distribution by at most
    e^ε; under replace-one it moves by more than e^(ε/2), so no smaller ε is claimed."""
    epsilon, patterns = 1.0, list(itertools.product((0, 1), repeat=3))
    worst_add_remove = worst_replace = 0.0
    for n in range(4):
        for rows in itertools.product(patterns, repeat=n):
            counts = [sum(r[j] for r in rows) for j in range(3)]
            for extra in patterns:  # add one row (removing it is the same pair reversed)
                added = [c + extra[j] for j, c in enumerate(counts)]
                worst_add_remove = max(worst_add_remove, _max_log_ratio(counts, added, epsilon))
            for i, new in itertools.product(range(n), patterns):  # replace row i
                replaced = [c - rows[i][j] + new[j] for j, c in enumerate(counts)]
                worst_replace = max(worst_replace, _max_log_ratio(counts, replaced, epsilon))
    assert worst_add_remove <= epsilon + 1e-12 and worst_replace <= epsilon + 1e-12
    assert worst_replace > epsilon / 2 + 0.1


def _pure(epsilon: float) -> privacy_loss_distribution.PrivacyLossDistribution:
    """dp_accounting's PLD of an ε-DP mechanism (the exponential mechanism's worst case)."""
    return privacy_loss_distribution.from_privacy_parameters(
        common.DifferentialPrivacyParameters(epsilon, 0.0), value_discretization_interval=1e-4
    )


def _entry(name: str, selection: Selection | None) -> CountedRelease:
    record = make_record(name, 1.1, dataset="digits-hmac:" + "a" * 32, dataset_size=1437)
    return CountedRelease.of(
        release_of(f"r-{name}", "lc", [record], [1.0]),
        versions={name: "m v1"},
        delta=DELTA,
        policy="p",
        policy_version=1,
        evaluation=Evaluation(1.0, 360),
        selections=(selection,) if selection is not None else (),
    )


def test_the_ledger_counts_the_validation_rows_and_dp_accounting_agrees(tmp_path: Path) -> None:
    """Two privately tuned releases (selection ε 0.5 and 1.0 on the same validation rows) and
    one untuned: the ledger states the validation rows' ε = 1.5 (their sum, δ = 0), which
    dp_accounting's PLD composition of two ε-DP mechanisms re-derives; one person (one
    identifier: disjoint splits) is bounded by the largest of the three splits' ε; the entry's
    selection survives the signed document."""
    store = StateStore(LocalBackend(tmp_path / "state"), WorkflowKey.generate())
    for name, selection in (("a", Selection(0.5, 144, 6)), ("b", Selection(1.0, 144, 16))):
        serving.count(store, _entry(name, selection), None)
    serving.count(store, _entry("c", None), None)
    state = serving.read_state(store, "digits-hmac:" + "a" * 32)
    assert [e.selections for e in state.ledger] == [
        (Selection(0.5, 144, 6),),
        (Selection(1.0, 144, 16),),
        (),
    ]
    statement = state.statement(DELTA)
    assert statement.validation == 1.5
    derived = _pure(0.5).compose(_pure(1.0)).get_epsilon_for_delta(1e-12)
    assert 1.5 * 0.99 <= derived <= 1.5 + 1e-9
    assert _pure(0.5).compose(_pure(1.0)).get_epsilon_for_delta(1e-3) < 1.5
    person = statement.person
    assert person.composition == Composition.PARALLEL
    assert person.epsilon == max(statement.training.epsilon, statement.test.epsilon, 1.5)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tune": True}, "tune"),
        ({"tune": 1}, "tune"),
        ({"tune": "yes"}, "tune"),
        ({"selection_epsilon": True}, "selection_epsilon"),
        ({"selection_epsilon": "1.0"}, "selection_epsilon"),
        ({"selection_epsilon": 0.0}, "selection_epsilon"),
        ({"selection_epsilon": math.nan}, "selection_epsilon"),
        ({"selection_epsilon": math.inf}, "selection_epsilon"),
    ],
)
def test_policy_fields_are_strictly_typed(fields: dict, field: str) -> None:
    with pytest.raises(PolicyError) as caught:
        policy_from_dict({**POLICY, **fields})
    assert caught.value.field == field and field in str(caught.value)


@pytest.mark.parametrize(
    "fields",
    [{"method": "lc"}, {"method": "rs"}, {"tune_weights": True}, {"gating_bound": "structured"}],
)
def test_private_tuning_needs_auto_under_the_generic_gate(fields: dict) -> None:
    with pytest.raises(PolicyError, match="tune 'private'"):
        policy_from_dict({**POLICY, "tune": "private", **fields})


def test_private_tuning_defaults() -> None:
    policy = policy_from_dict({**POLICY, "tune": "private"})
    assert policy.tune == "private" and policy.selection_epsilon == 1.0
    assert policy_from_dict(POLICY).tune == "none"


def _records() -> list:
    return [make_record(f"c{i}", sigma) for i, sigma in enumerate((0.8, 1.2, 2.0, 3.0))]


@pytest.mark.parametrize("target", [0.5, 2.0, 6.0])
def test_the_stated_bound_covers_every_consulted_candidate(target: float) -> None:
    """Every option's own ε is within its plan's bound, which is within the target; auto's
    release is an option only where the consulted set's joint release fits; whatever wins, the
    release states the consulted set's bound."""
    records = _records()
    offered = {m: calibrate(records, m, target, DELTA) for m in (Method.RS, Method.LC, "mixture")}
    auto = choose_method(offered, records).calibration
    plan = tuning_plan(records, auto, offered[Method.LC])
    assert plan.bound.epsilon <= target
    assert set(plan.consulted) >= set(offered[Method.LC].report.used_candidates)
    has_auto = plan.options[0].weights is None
    assert has_auto == (set(auto.report.used_candidates) <= set(plan.consulted))
    for index in (0, len(plan.options) - 1):  # auto (where offered) and a grid point
        release = tuned_release(plan, index, records)
        assert release.report.epsilon == plan.bound.epsilon
        assert set(release.report.used_candidates) <= set(plan.consulted)
        assert release.report.structured is None or release.report.structured.epsilon_pld is None


def test_a_rerun_reuses_the_kept_selection(tmp_path: Path) -> None:
    """The selection is stored create-once before use: a second call with other counts (and
    another ε) returns the kept choice and its ε; an altered record fails closed."""
    workspace = Workspace(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "home", None)
    labels = ["auto (mixture)", "lc (inverse-variance)", "lc 0.5,0.5"]
    key = selection_key({"options": labels, "target": [2.0, DELTA]})
    first = stored_selection(workspace, key, labels, [0, 0, 10_000], 1000, 1.0)
    assert first == (2, Selection(1.0, 1000, 3, key=key))
    again = stored_selection(workspace, key, labels, [10_000, 0, 0], 1000, 5.0)
    assert again == first
    path = workspace.private_dir("audit") / f"{key}.json"
    record = json.loads(path.read_text())
    assert "counts" not in json.dumps(record) and record["drawn_index"] == 2
    record["selection"]["delta"] = 0.5
    path.write_text(json.dumps(record))
    with pytest.raises(IntegrityError, match="altered"):
        stored_selection(workspace, key, labels, [0, 0, 10_000], 1000, 1.0)


def test_two_selections_that_choose_one_release_are_both_charged(tmp_path: Path) -> None:
    """Two private selections (two draw keys) can choose the same merge, so one release hash:
    each spent its ε on the validation rows, so the ledger entry keeps both and the
    validation rows' ε is their sum; the same selection counted again (a rerun reusing its
    draw) changes nothing; an entry written before entries held several still reads."""
    store = StateStore(LocalBackend(tmp_path / "state"), WorkflowKey.generate())
    first = Selection(0.5, 144, 6, key="selection-" + "1" * 40)
    second = Selection(0.75, 144, 9, key="selection-" + "2" * 40)
    for selection in (first, second, first):
        serving.count(store, _entry("a", selection), None)
    state = serving.read_state(store, "digits-hmac:" + "a" * 32)
    (entry,) = state.ledger
    assert entry.selections == (first, second)
    assert state.statement(DELTA).validation == 1.25
    legacy = {**_entry("b", None).to_dict(), "selection": Selection(1.0, 144, 16).to_dict()}
    assert CountedRelease.from_dict(legacy).selections == (Selection(1.0, 144, 16),)
    with pytest.raises(RecordError, match="key is selection-"):
        Selection.from_dict({**first.to_dict(), "key": "../../etc"})
    with pytest.raises(ValueError, match="at most 100"):
        CountedRelease.from_dict({**_entry("c", None).to_dict(), "selections": [{}] * 101})


def test_the_cap_bounds_one_person_not_only_the_training_rows(tmp_path: Path) -> None:
    """A cap above the training rows' ε refuses a release when one person's ε — training,
    test and validation rows composed — goes above it (here the test rows: two estimates of
    ε 1.0 each), and refuses any release while a counted one has no recorded estimate (the
    test rows unbounded: asking for that release again does not bound them); a refused count
    writes nothing."""
    store = StateStore(LocalBackend(tmp_path / "state"), WorkflowKey.generate())
    key = serving.dataset_key("digits-hmac:" + "a" * 32)
    serving.count(store, _entry("a", None), None)
    training = serving.read_state(store, "digits-hmac:" + "a" * 32).cumulative(
        DELTA, _entry("b", None)
    )
    assert training.epsilon < 1.5  # the test rows' 2.0 is what the cap meets
    before = store.read(key).document
    with pytest.raises(RefusalError, match=r"one person's ε with this release is 2\.0000"):
        serving.count(store, _entry("b", None), 1.5)
    assert store.read(key).document == before
    assert serving.count(store, _entry("b", None), 2.0).epsilon == training.epsilon
    serving.count(store, replace(_entry("c", None), evaluation=None), None)  # no estimate kept
    serving.count(store, _entry("c", None), None)  # asked again: its estimate stays unknown
    assert serving.read_state(store, "digits-hmac:" + "a" * 32).entry("r-c").evaluation is None
    before = store.read(key).document
    with pytest.raises(RefusalError, match="cannot hold: the test rows' ε is not bounded"):
        serving.count(store, _entry("d", None), 100.0)
    assert store.read(key).document == before
