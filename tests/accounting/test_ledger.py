"""Release ledger (docs/design.md#release-ledger): the cumulative bound is the joint release of the
union."""

from __future__ import annotations

import pytest

from dpmerge.accounting.account import account
from dpmerge.accounting.ledger import ReleaseLedger, release_of
from dpmerge.errors import RefusalError

DELTA = 1e-5


def test_cumulative_bound_is_the_union_not_the_sum(tmp_path, ladder):
    ledger = ReleaseLedger(tmp_path / "ledger.json")
    first = release_of("r1", "lc", ladder, [0.5, 0.5, 0, 0, 0])
    second = release_of("r2", "lc", ladder, [0, 0.5, 0.5, 0, 0])
    one = ledger.record(first, DELTA)
    both = ledger.record(second, DELTA)
    union = account(ladder, "lc", [1 / 3, 1 / 3, 1 / 3, 0, 0], DELTA).generic
    assert both.epsilon_pld == pytest.approx(union.epsilon_pld)
    separate = account(ladder, "lc", [0, 0.5, 0.5, 0, 0], DELTA).generic.epsilon_pld
    assert both.epsilon_pld < one.epsilon_pld + separate  # reuse of s1.0 is not paid twice
    assert [r.release_id for r in ReleaseLedger(ledger.path).releases()] == ["r1", "r2"]
    # Re-recording a release is idempotent.
    ledger.record(second, DELTA)
    assert len(ledger.releases()) == 2


def test_rs_release_counts_every_candidate_with_positive_probability(ladder):
    release = release_of("rs", "rs", ladder, [0.9, 0.1, 0, 0, 0])
    assert [c.name for c in release.candidates] == ["s0.8", "s1.0"]


def test_cap_refuses_and_changes_nothing(tmp_path, ladder):
    ledger = ReleaseLedger(tmp_path / "ledger.json")
    ledger.record(release_of("r1", "lc", ladder, [0, 0, 0, 0.5, 0.5]), DELTA, cap=1.0)
    before = ledger.path.read_text()
    with pytest.raises(RefusalError, match="above the cap"):
        ledger.record(release_of("r2", "lc", ladder, [1, 0, 0, 0, 0]), DELTA, cap=1.0)
    assert ledger.path.read_text() == before
    assert ledger.cumulative(ladder[0].dataset, DELTA).epsilon < 1.0
    assert ledger.cumulative("other-dataset", DELTA) is None
