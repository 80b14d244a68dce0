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
"""

from dpmerge.training.config import (
    DEFAULT_GRAD_SAMPLE_MODE,
    DEFAULT_LEARNING_RATE,
    GRAD_SAMPLE_MODES,
    LINEAR_EXACT,
    LINEAR_EXACT_MODELS,
    OPACUS_MODES,
    Parameter,
    RunOptions,
    TrainConfig,
    TrainingConfigError,
    declared_parameters,
)
from dpmerge.training.history import EpochMetrics
from dpmerge.training.plan import MechanismPlan, plan_mechanism
from dpmerge.training.run import (
    TrainResult,
    kept_name,
    save_candidate,
    train_candidate,
    train_candidates,
    train_kept,
)

__all__ = [
    "DEFAULT_GRAD_SAMPLE_MODE",
    "DEFAULT_LEARNING_RATE",
    "GRAD_SAMPLE_MODES",
    "LINEAR_EXACT",
    "LINEAR_EXACT_MODELS",
    "OPACUS_MODES",
    "EpochMetrics",
    "MechanismPlan",
    "Parameter",
    "RunOptions",
    "TrainConfig",
    "TrainResult",
    "TrainingConfigError",
    "declared_parameters",
    "kept_name",
    "plan_mechanism",
    "save_candidate",
    "train_candidate",
    "train_candidates",
    "train_kept",
]
