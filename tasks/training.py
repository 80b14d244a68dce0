"""Training tasks: one candidate per task (never one step), then its registration."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from prefect import get_run_logger, task

from dpmerge import policy_merge as pm
from dpmerge.data import DatasetSplits
from dpmerge.formatting import epsilon_text
from dpmerge.training import (
    RunOptions,
    TrainConfig,
    TrainingConfigError,
    declared_parameters,
    kept_name,
    save_candidate,
    train_candidate,
    train_kept,
)
from tasks.common import LOCAL, REMOTE


@dataclass(frozen=True)
class CandidateSpec:
    """One candidate to train: its training parameters and how its run is hosted, both as
    ``dpmerge.training`` declares them (the split is dpmerge's default, so merges find the
    same validation rows)."""

    config: TrainConfig
    options: RunOptions = field(default_factory=RunOptions)
    keep_last_epochs: int = 1
    """Register the run's weights at the end of each of its last N epochs (checkpoints of one
    run, counted once by a merge: docs/design.md#release-units); 1: the final weights only."""

    def __post_init__(self) -> None:
        if self.config.name is None:
            raise TrainingConfigError("a candidate to train needs a name")
        keep = self.keep_last_epochs
        if type(keep) is not int or not 1 <= keep <= self.config.epochs:
            raise TrainingConfigError(
                f"keep_last_epochs must be a whole number in 1..{self.config.epochs} "
                f"(the run's epochs), got {keep!r}"
            )

    @property
    def name(self) -> str:
        assert self.config.name is not None
        return self.config.name

    @property
    def kept_epochs(self) -> list[int]:
        """The epochs whose weights become candidates (empty: only the final weights)."""
        if self.keep_last_epochs == 1:
            return []
        return list(range(self.config.epochs - self.keep_last_epochs + 1, self.config.epochs + 1))

    @property
    def candidate_names(self) -> list[str]:
        """The names of the candidates this spec registers (their records' names)."""
        return [kept_name(self.name, epoch) for epoch in self.kept_epochs] or [self.name]

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, Any]) -> CandidateSpec:
        """The spec of flat flow parameters (every name a declared training parameter)."""
        hosting = {p.name for p in declared_parameters(RunOptions)}
        own = {KEEP: parameters[KEEP]} if KEEP in parameters else {}
        return cls(
            TrainConfig(**{k: v for k, v in parameters.items() if k not in hosting and k != KEEP}),
            RunOptions(**{k: v for k, v in parameters.items() if k in hosting}),
            **own,
        )

    def parameters(self) -> dict[str, Any]:
        """Flat plain parameters, as a ``train-candidate`` deployment run takes them."""
        flat = {**asdict(self.config), **asdict(self.options), KEEP: self.keep_last_epochs}
        return {k: v.value if isinstance(v, Enum) else v for k, v in flat.items()}


KEEP = "keep_last_epochs"


@lru_cache(maxsize=4)
def data_splits(name: str, root: str | None, limit: int | None) -> DatasetSplits:
    """The dataset as training and imports load it (dpmerge's split, so merges find the same
    validation rows), cached per process."""
    from dpmerge.data import load_dataset

    root = root or os.environ.get(pm.DATA_ROOT_ENV) or None
    return load_dataset(
        name,
        root,
        seed=pm.SPLIT_SEED,
        validation_fraction=pm.VALIDATION_FRACTION,
        limit=limit,
    )


@task(name="train-candidate", task_run_name="train-{spec.name}", **LOCAL)
def train(spec: CandidateSpec, out_root: str) -> list[str]:
    """Train one DP-SGD run and write the model directory of each candidate it keeps (its
    final weights, or with ``spec.keep_last_epochs`` its last epochs'); returns the paths."""
    config, options = spec.config, spec.options
    torch.set_num_threads(options.torch_threads)
    data = data_splits(config.dataset, options.data_root, options.limit)
    if spec.kept_epochs:
        resume = Path(out_root) / f".{spec.name}-training-state.pt"
        results = train_kept(config, data, spec.kept_epochs, resume)
    else:
        results = iter([train_candidate(config, data)])
    logger, paths = get_run_logger(), []
    for result in results:
        name = result.record.name
        paths.append(str(save_candidate(result, Path(out_root) / name, config.delta)))
        logger.info(
            "trained %s: σ = %.4g, q = %.5g, T = %d in %.1f s",
            name,
            result.record.noise_multiplier,
            result.record.sample_rate,
            result.record.steps,
            result.train_seconds,
        )
        # a candidate's accuracy is internal: beside an RS release's it names the drawn one
        logger.debug("%s: validation accuracy %.4f", name, result.metrics["validation_accuracy"])
    return paths


@task(name="register-candidate", **REMOTE)
def register(workspace: pm.Workspace, path: str) -> dict[str, Any]:
    """Register a trained candidate directory (idempotent on its content hash)."""
    from dpmerge.artifacts import load_model_dir

    registered = workspace.registry().register_candidate(path)
    loaded = load_model_dir(path)
    privacy = loaded.candidate_privacy or {}
    info = {
        "name": loaded.record.name if loaded.record else Path(path).name,
        "registered_model": registered.name,
        "version": registered.version,
        "reused": registered.reused,
        "epsilon": privacy.get("epsilon"),
        "accountant": privacy.get("accountant"),
        "epsilon_pld": privacy.get("epsilon_pld"),
        "epsilon_rdp": privacy.get("epsilon_rdp"),
        "delta": privacy.get("delta"),
        "noise_multiplier": getattr(loaded.record, "noise_multiplier", None),
        "dataset_size": getattr(loaded.record, "dataset_size", None),
        "validation_accuracy": loaded.metrics.get("validation_accuracy"),
        "test_accuracy": loaded.metrics.get("test_accuracy"),
    }
    get_run_logger().info(
        "registered %s as %s v%s (ε = %s)",  # rounded up, as every displayed ε
        info["name"],
        registered.name,
        registered.version,
        epsilon_text(info["epsilon"]),
    )
    return info


@task(name="prime-merge-caches", **REMOTE)
def prime_caches(
    workspace: pm.Workspace, dataset: str, model: str, data_root: str | None = None
) -> None:
    """Candidates, evaluation split and PLDs cached for the next policy merge on this host."""
    start = time.perf_counter()
    pool = pm.prime_caches(workspace, dataset, model, data_root)
    get_run_logger().info(
        "merge caches primed for %d candidates of %s in %.1f s",
        len(pool.versions),
        pool.registered_model,
        time.perf_counter() - start,
    )


@task(name="find-registered-candidate", **REMOTE)
def find_registered(workspace: pm.Workspace, name: str) -> dict[str, Any]:
    """The registry entry of a candidate another process trained (by its record name)."""
    from dpmerge.registry import RegistryError, tag_float

    found = workspace.registry().ready_candidates(candidate=name)
    if not found:
        raise RegistryError(f"candidate {name!r} is not registered (ready)")
    mv = max(found, key=lambda v: int(v.version))
    return {
        "name": name,
        "registered_model": mv.name,
        "version": mv.version,
        "reused": False,
        "epsilon": tag_float(mv.tags.get("dp.epsilon")),
        "accountant": mv.tags.get("dp.accountant"),
        "epsilon_pld": tag_float(mv.tags.get("dp.epsilon_pld")),
        "epsilon_rdp": tag_float(mv.tags.get("dp.epsilon_rdp")),
        "delta": tag_float(mv.tags.get("dp.delta")),
        "noise_multiplier": tag_float(mv.tags.get("dp.noise_multiplier")),
        "dataset_size": None,  # not published as a tag
        "validation_accuracy": None,
        "test_accuracy": tag_float(mv.tags.get("dp.accuracy")),
    }


@task(name="run-training-deployment", task_run_name="deploy-{spec.name}", **LOCAL)
def run_training_deployment(
    deployment: str, spec: CandidateSpec, timeout_s: float | None
) -> list[str]:
    """Run one candidate's training as a deployment run (e.g. on the ``gpu`` pool), wait for
    it; the names of the candidates it registered."""
    from prefect.deployments import run_deployment

    flow_run = run_deployment(
        deployment,
        parameters=spec.parameters(),
        timeout=timeout_s,
        poll_interval=2,
        flow_run_name=f"train-{spec.name}",
    )
    state = flow_run.state
    if state is None or not state.is_completed():
        raise RuntimeError(
            f"deployment run {flow_run.name} for candidate {spec.name} ended "
            f"{state.name if state else 'without a state'}: {state.message if state else ''}"
        )
    return spec.candidate_names
