"""Mechanism records built without training, shared by the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpmerge.accounting.private_accuracy import PrivateAccuracy
from dpmerge.accounting.records import MechanismRecord

DELTA = 1e-5
Q = 1 / 235  # what Opacus' DPDataLoader runs for 60 000 rows at batch 256
T = 2350  # 10 epochs


def make_record(
    name: str,
    sigma: float,
    *,
    steps: int = T,
    sample_rate: float = Q,
    noise_lineage: str | None = None,
    batch_lineage: str | None = None,
    optimizer: str = "sgd",
    dataset: str = "fashion-mnist:test",
    learning_rate: float = 2.0,
    clip_norm: float = 1.0,
    batch: float = 255.0,
    initialisation: str | None = "seed-0",
    dataset_size: int | None = 60000,
    run_id: str | None = None,
) -> MechanismRecord:
    return MechanismRecord(
        name=name,
        noise_multiplier=sigma,
        sample_rate=sample_rate,
        steps=steps,
        clip_norm=clip_norm,
        learning_rate=learning_rate,
        expected_batch_size=batch,
        optimizer=optimizer,
        noise_lineage=noise_lineage or f"run-{name}/noise-1",
        batch_lineage=batch_lineage or f"run-{name}/batch-1",
        dataset=dataset,
        neighbouring="add_or_remove_one",
        sampling="poisson",
        dataset_size=dataset_size,
        initialisation=initialisation,
        run_id=run_id,
    )


def make_checkpoints(
    sigma: float, steps: tuple[int, ...] = (100, 150, 200)
) -> list[MechanismRecord]:
    """Kept checkpoints of one run (one run id, one noise and batch stream)."""
    return [
        make_record(
            f"run{sigma}-{t}",
            sigma,
            steps=t,
            sample_rate=0.01,
            batch=600.0,
            run_id=f"run-{sigma}",
            noise_lineage=f"noise-{sigma}",
            batch_lineage=f"batches-{sigma}",
        )
        for t in steps
    ]


def train_digits(root: Path, sigma: float, *, limit: int | None = None, **config: Any) -> Path:
    """A small digits DP-SGD candidate (3 epochs, batch 64) trained and saved under ``root``."""
    from dpmerge.data import load_dataset
    from dpmerge.training import TrainConfig, save_candidate, train_candidate

    data = load_dataset("digits", limit=limit)
    name = f"digits-s{sigma}{'-l' if limit else ''}{config.pop('suffix', '')}"
    settings = {"epochs": 3, "batch_size": 64, "learning_rate": 1.0, **config}
    config_ = TrainConfig(
        dataset="digits", model="logreg", noise_multiplier=sigma, name=name, **settings
    )
    return save_candidate(train_candidate(config_, data), root / name, DELTA)


def synthetic_candidates(
    root: Path, sigmas: dict[str, float], dataset: str, *, delta: float = DELTA
) -> list[Path]:
    """Candidate directories with random 4×4 → 3 logistic-regression weights and records
    accounted by the real accountant (no training): one per ``name: σ``."""
    import torch

    from dpmerge.accounting.candidate import candidate_bound
    from dpmerge.artifacts import ModelSpec, save_model_dir

    dirs = []
    for i, (name, sigma) in enumerate(sigmas.items()):
        generator = torch.Generator().manual_seed(i)
        weights = {
            "linear.weight": torch.randn(3, 16, generator=generator),
            "linear.bias": torch.randn(3, generator=generator),
        }
        record = make_record(
            name,
            sigma,
            steps=100,
            sample_rate=0.01,
            learning_rate=0.5,
            batch=100.0,
            dataset=dataset,
        )
        dirs.append(
            save_model_dir(
                root / name,
                weights,
                ModelSpec("logreg", (1, 4, 4), 3),
                record=record,
                candidate_privacy=candidate_bound(record, delta).to_dict(),
                metrics={"test_accuracy": 0.70 + i / 100, "validation_accuracy": 0.7},
            )
        )
    return dirs


def laplace_delta(estimate: PrivateAccuracy, epsilon: float) -> float:
    """δ(ε) of the estimate under dp_accounting's PLD accountant (add-or-remove-one, the
    records' relation): a Laplace event with noise multiplier scale/sensitivity."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4
    )
    accountant.compose(dp_accounting.LaplaceDpEvent(estimate.scale / (1 / estimate.n)))
    return float(accountant.get_delta(epsilon))
