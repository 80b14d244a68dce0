"""Fixtures for the accounting tests."""

from __future__ import annotations

import pytest
from factories import make_record

from dpmerge.accounting.records import MechanismRecord


@pytest.fixture(scope="session")
def ladder() -> tuple[MechanismRecord, ...]:
    """Five independent candidates, σ from 0.8 to 3 (the utility experiment's ladder)."""
    return tuple(make_record(f"s{s}", s) for s in (0.8, 1.0, 1.5, 2.0, 3.0))


@pytest.fixture(scope="session")
def short_ladder() -> tuple[MechanismRecord, ...]:
    """Cheap candidates (200 steps at q = 0.01) for property tests."""
    return tuple(
        make_record(f"t{s}", s, steps=200, sample_rate=0.01, batch=600.0)
        for s in (0.7, 1.0, 1.4, 2.0)
    )
