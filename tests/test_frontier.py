"""The frontier study (docs/design.md#studies): calibrated merges of real (tiny) candidates,
evaluated."""

from __future__ import annotations

import json

import pytest

from dpmerge.artifacts import load_model_dir
from dpmerge.data import load_dataset
from dpmerge.studies.frontier import frontier, plot_frontier
from dpmerge.training import TrainConfig, save_candidate, train_candidate


@pytest.fixture(scope="module")
def digits_candidates(tmp_path_factory):
    data = load_dataset("digits", seed=0)
    root = tmp_path_factory.mktemp("candidates")
    dirs = []
    for i, sigma in enumerate((0.8, 1.2, 2.0)):
        config = TrainConfig(
            dataset="digits",
            model="logreg",
            noise_multiplier=sigma,
            epochs=2,
            batch_size=64,
            init_seed=0,
            noise_seed=10 + i,
            name=f"s{sigma}",
        )
        dirs.append(
            load_model_dir(save_candidate(train_candidate(config, data), root / f"s{sigma}", 1e-5))
        )
    return data, dirs


def test_frontier_rows_are_certified_and_evaluated(digits_candidates, tmp_path):
    data, dirs = digits_candidates
    eps = sorted(
        json.loads(d.path.joinpath("record.json").read_text())["privacy"]["epsilon"] for d in dirs
    )
    targets = [eps[0] * 0.5, (eps[0] + eps[1]) / 2, eps[2] * 1.5]
    table = frontier(dirs, data, targets, 1e-5)
    candidates = table[table.kind == "candidate"]
    assert len(candidates) == 3
    merges = table[table.kind != "candidate"]
    assert set(merges.kind) == {"rs", "lc-generic", "mixture", "auto", "lc-structured"}
    assert targets[0] not in set(merges.target_epsilon)  # below the most private: infeasible
    for row in merges.itertuples():
        assert row.epsilon <= row.target_epsilon
        assert 0.0 <= row.test_accuracy <= 1.0
        weights = json.loads(row.weights)
        if row.method == "mixture":  # one of two merges (or one), drawn with these odds
            assert abs(sum(m["probability"] for m in weights) - 1) < 1e-9
            assert all(abs(sum(m["weights"]) - 1) < 1e-5 for m in weights)
        else:
            assert abs(sum(weights) - 1) < 1e-5
    # At the loosest target the noise proxy's best subset is every candidate, at its default
    # inverse-variance weights (nothing is tuned on validation accuracy).
    loose = merges[(merges.target_epsilon == targets[-1]) & (merges.kind == "lc-generic")]
    weights = json.loads(loose.weights.iloc[0])
    precision = [d.record.noise_multiplier**-2 for d in dirs]
    assert weights == pytest.approx([p / sum(precision) for p in precision], abs=1e-6)
    png = plot_frontier(table, tmp_path / "frontier.png", title="digits")
    assert png.stat().st_size > 10_000


def test_frontier_refuses_data_that_did_not_train_the_candidates(digits_candidates):
    _, dirs = digits_candidates
    other = load_dataset("digits", seed=1)  # a different split: a different training set
    with pytest.raises(Exception, match="fingerprint"):
        frontier(dirs, other, [1.0], 1e-5)
