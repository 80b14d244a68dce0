"""Release ledger arithmetic (docs/design.md#release-ledger): the cumulative bound is the joint
release of the union, not the sum."""

from __future__ import annotations

import pytest

from dpmerge.accounting.account import account
from dpmerge.accounting.ledger import cumulative_bound, release_of
from dpmerge.errors import RecordError

DELTA = 1e-5


def test_cumulative_bound_is_the_union_not_the_sum(ladder):
    first = release_of("r1", "lc", ladder, [0.5, 0.5, 0, 0, 0])
    second = release_of("r2", "lc", ladder, [0, 0.5, 0.5, 0, 0])
    one = cumulative_bound([first], DELTA)
    both = cumulative_bound([first, second], DELTA)
    union = account(ladder, "lc", [1 / 3, 1 / 3, 1 / 3, 0, 0], DELTA).generic
    assert both.epsilon_pld == pytest.approx(union.epsilon_pld)
    separate = account(ladder, "lc", [0, 0.5, 0.5, 0, 0], DELTA).generic.epsilon_pld
    assert both.epsilon_pld < one.epsilon_pld + separate  # reuse of s1.0 is not paid twice
    assert cumulative_bound([first, second, second], DELTA) == both  # a release counts once


def test_rs_release_counts_every_candidate_with_positive_probability(ladder):
    release = release_of("rs", "rs", ladder, [0.9, 0.1, 0, 0, 0])
    assert [c.name for c in release.candidates] == ["s0.8", "s1.0"]


def test_two_records_under_one_name_are_refused(ladder):
    first = release_of("r1", "lc", ladder, [1, 0, 0, 0, 0])
    changed = ladder[0].model_copy(update={"clip_norm": ladder[0].clip_norm * 2})
    second = release_of("r2", "lc", [changed], [1])
    with pytest.raises(RecordError, match="two different candidates"):
        cumulative_bound([first, second], DELTA)
    with pytest.raises(RecordError, match="at least one candidate"):
        release_of("r3", "lc", ladder, [0, 0, 0, 0, 0])
