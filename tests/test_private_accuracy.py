"""The private test-accuracy estimate (docs/design.md#row-protection): its ε re-derived with
dp_accounting, its sensitivity checked on every neighbour of small test sets, its noise from
the OS generator, its draw kept once per release, and the cards' row table."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest
from factories import laplace_delta

from dpmerge.accounting.private_accuracy import laplace_noise, private_accuracy
from dpmerge.errors import IntegrityError, RecordError
from dpmerge.policy_merge import draws
from dpmerge.policy_merge.draws import stored_accuracy
from dpmerge.workspace import Workspace

RELEASE = "a" * 64


@pytest.mark.parametrize(("n", "epsilon"), [(360, 1.0), (10_000, 0.25), (50, 3.0)])
def test_the_estimates_epsilon_is_re_derived_with_dp_accounting(n: int, epsilon: float) -> None:
    estimate = private_accuracy(0.9, n, epsilon)
    assert (estimate.epsilon, estimate.delta, estimate.n) == (epsilon, 0.0, n)
    assert estimate.scale == pytest.approx(1 / (n * epsilon), rel=1e-12)
    assert laplace_delta(estimate, epsilon) <= 1e-12  # ε-DP with δ = 0 (up to PLD's rounding)
    assert laplace_delta(estimate, 0.99 * epsilon) > 1e-4  # and no smaller ε is claimed


def test_the_sensitivity_is_one_over_n_test_for_every_neighbour() -> None:
    """Accuracy c/n against each add-or-remove-one and replace-one neighbour: it moves by at
    most 1/n, n the size of the evaluated test set (n public, the scale fixed from it)."""
    worst = 0.0
    for n in range(1, 60):
        for c in range(n + 1):
            neighbours = [(c, n + 1), (c + 1, n + 1)]  # add a wrong or a right row
            if n > 1:  # remove a right or a wrong row
                neighbours += [(c - 1, n - 1)] if c > 0 else []
                neighbours += [(c, n - 1)] if c < n else []
            neighbours += [(c + d, n) for d in (-1, 1) if 0 <= c + d <= n]  # replace one
            for k, m in neighbours:
                worst = max(worst, abs(c / n - k / m) * n)
    assert worst == pytest.approx(1.0)


def test_the_noise_is_laplace_from_the_os_generator_and_clipped() -> None:
    random.seed(0)
    first = laplace_noise(1.0)
    random.seed(0)
    assert laplace_noise(1.0) != first  # not Python's seeded generator
    draws_ = [laplace_noise(0.5) for _ in range(20_000)]
    assert statistics.fmean(abs(x) for x in draws_) == pytest.approx(0.5, rel=0.05)  # E|X| = b
    assert abs(statistics.fmean(draws_)) < 0.03
    values = {private_accuracy(1.0, 10, 0.01).value for _ in range(200)}
    assert all(0.0 <= v <= 1.0 for v in values) and 1.0 in values and len(values) > 2


@pytest.mark.parametrize(
    ("accuracy", "n", "epsilon", "message"),
    [
        (0.9, 100, True, "finite number"),
        (0.9, 100, 0.0, "positive"),
        (0.9, 100, float("nan"), "finite number"),
        (0.9, 100, "1", "finite number"),
        (0.9, True, 1.0, "positive integer"),
        (0.9, 0, 1.0, "positive integer"),
        (True, 100, 1.0, "a number"),
        (1.5, 100, 1.0, "within"),
    ],
)
def test_bad_input_is_one_clear_line(accuracy, n, epsilon, message) -> None:
    with pytest.raises(RecordError, match=message) as error:
        private_accuracy(accuracy, n, epsilon)
    assert "\n" not in str(error.value)


@pytest.fixture
def workspace(tmp_path: Path) -> Workspace:
    return Workspace(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path, None)


def test_the_draw_is_kept_once_per_release(workspace: Workspace, monkeypatch) -> None:
    """A retry publishes the kept estimate (no second noise draw, whatever it measures or its
    policy's ε now); the record holds the estimate only; an altered record is refused."""
    first = stored_accuracy(workspace, RELEASE, 0.9, 360, 1.0)
    path = workspace.home / "audit" / f"{RELEASE}.test-accuracy.json"
    record = json.loads(path.read_text())
    assert record["metrics"] == first.metrics()  # the estimate, never the exact accuracy
    assert set(record) == {"schema", "release", "metrics", "drawn_at"}
    monkeypatch.setattr(draws, "private_accuracy", lambda *a: pytest.fail("drew again"))
    assert stored_accuracy(workspace, RELEASE, 0.9, 360, 1.0) == first
    assert stored_accuracy(workspace, RELEASE, 0.5, 360, 2.0) == first  # its own ε stands
    with pytest.raises(IntegrityError, match="does not match its test rows"):
        stored_accuracy(workspace, RELEASE, 0.9, 361, 1.0)
    path.chmod(0o600)
    path.write_text(json.dumps({**record, "metrics": {**record["metrics"], "test_n": True}}))
    with pytest.raises(IntegrityError, match="was altered"):
        stored_accuracy(workspace, RELEASE, 0.9, 360, 1.0)


def test_a_concurrent_runs_draw_wins(workspace: Workspace, monkeypatch) -> None:
    """Two runs that both found no record: the one that stored second uses the first's."""
    winner = stored_accuracy(workspace, RELEASE, 0.9, 360, 1.0)
    real = draws._read
    seen: list[str] = []

    def late(where: Workspace, key: str):  # the first read misses the other run's record
        seen.append(key)
        return None if len(seen) == 1 else real(where, key)

    monkeypatch.setattr(draws, "_read", late)
    assert stored_accuracy(workspace, RELEASE, 0.9, 360, 1.0) == winner and len(seen) == 2
