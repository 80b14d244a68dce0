"""DP-SGD training of candidates, recorded from what actually ran
(docs/design.md#mechanism-record, docs/design.md#accounting-primitives; docs/training.md).

One candidate is plain SGD on Poisson-sampled batches with per-example clipping and Gaussian
noise. The package, one concern a module:

* :mod:`~dpmerge.training.config`: the training parameters, declared once (:class:`TrainConfig`,
  :class:`RunOptions`); the CLI, the task and the flows derive theirs from them;
* :mod:`~dpmerge.training.plan`: q = 1/len(loader) as Opacus' ``DPDataLoader`` samples, T in
  steps, the divisor int(n·q), and σ calibrated to a target ε at that q and T;
* :mod:`~dpmerge.training.streams`: the noise and batch seeds and their lineages;
* :mod:`~dpmerge.training.engines`: the engines behind one protocol, Opacus and the exact
  linear engine for ``logreg``;
* :mod:`~dpmerge.training.progress` and :mod:`~dpmerge.training.history`: the step loop's
  bookkeeping and the per-epoch history, scored with :mod:`dpmerge.evaluation`;
* :mod:`~dpmerge.training.checkpoint`: save and resume, bit-identical to an uninterrupted run;
* :mod:`~dpmerge.training.record`: the mechanism record, read off what the engine ran;
* :mod:`~dpmerge.training.run`: :func:`train_candidate`, :func:`train_kept` (one run kept at
  several epochs) and :func:`save_candidate`.

Names load on first use (as :mod:`dpmerge` does): the declarations of
:mod:`~dpmerge.training.config` import no torch, so ``dpmerge train`` parses and refuses its
options before torch loads.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DEFAULT_GRAD_SAMPLE_MODE": "dpmerge.training.config",
    "DEFAULT_LEARNING_RATE": "dpmerge.training.config",
    "GRAD_SAMPLE_MODES": "dpmerge.training.config",
    "LINEAR_EXACT": "dpmerge.training.config",
    "LINEAR_EXACT_MODELS": "dpmerge.training.config",
    "OPACUS_MODES": "dpmerge.training.config",
    "Parameter": "dpmerge.training.config",
    "RunOptions": "dpmerge.training.config",
    "TrainConfig": "dpmerge.training.config",
    "TrainingConfigError": "dpmerge.training.config",
    "declared_parameters": "dpmerge.training.config",
    "EpochMetrics": "dpmerge.training.history",
    "MechanismPlan": "dpmerge.training.plan",
    "plan_mechanism": "dpmerge.training.plan",
    "TrainResult": "dpmerge.training.run",
    "kept_name": "dpmerge.training.run",
    "save_candidate": "dpmerge.training.run",
    "train_candidate": "dpmerge.training.run",
    "train_candidates": "dpmerge.training.run",
    "train_kept": "dpmerge.training.run",
}
"""Public name → the module defining it."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dpmerge.training' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
