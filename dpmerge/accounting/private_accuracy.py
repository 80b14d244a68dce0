"""A differentially private estimate of a released model's test accuracy: the Laplace mechanism
on the fraction of test rows it labels correctly (docs/design.md#row-protection).

The accuracy is a mean of n_test values in {0, 1}. n_test is public (the design treats every
split's size as public), and the scale is fixed from it: for any neighbour of the evaluated test
rows under add-or-remove-one (the relation the records carry) the accuracy moves by at most
1/max(n, n') ≤ 1/n_test, and by at most 1/n_test under replace-one. Laplace noise of scale
1/(n_test·ε) is therefore ε-DP with δ = 0, exactly (no accountant's discretisation involved);
tests re-derive it with dp_accounting's ``LaplaceDpEvent`` under its PLD accountant. The noise
comes from the OS's cryptographic generator, never from a seed; clipping to [0, 1] is
post-processing. The exact accuracy is not kept: only the estimate leaves this module.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpmerge.errors import RecordError
from dpmerge.vocabulary import EvaluationMechanism

METRIC = "test_accuracy"
"""The metric the estimate is published as, and that ``min_accuracy`` gates on."""
PRIVACY_KEYS = ("test_accuracy_epsilon", "test_accuracy_delta", "test_accuracy_mechanism")


TEST_ROWS = "the number of test rows"


def positive_finite(value: Any, what: str) -> float:
    """``value`` as a float: strict (a boolean is not a number), finite and positive
    (:class:`RecordError` naming ``what`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RecordError(f"{what} must be a finite number, got {value!r}")
    if value <= 0:
        raise RecordError(f"{what} must be positive, got {value!r}")
    return float(value)


def positive_int(value: Any, what: str) -> int:
    """``value`` as a strict positive integer (:class:`RecordError` naming ``what`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecordError(f"{what} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Evaluation:
    """What publishing a release's estimate spent on its test rows, as the release ledger
    records it (docs/design.md#release-ledger): ε-DP with δ = 0 by ``mechanism`` on ``n``
    test rows."""

    epsilon: float
    n: int
    mechanism: EvaluationMechanism = EvaluationMechanism.LAPLACE
    delta: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "mechanism": self.mechanism.value,
            "n": self.n,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Evaluation:
        """Strict: exactly these four fields, ε finite and positive, δ = 0, a known mechanism
        and a positive row count (:class:`RecordError` otherwise)."""
        if not isinstance(data, Mapping) or set(data) != {"epsilon", "delta", "mechanism", "n"}:
            raise RecordError(
                f"an evaluation record holds epsilon, delta, mechanism and n, got {data!r}"
            )
        if data["mechanism"] not in set(EvaluationMechanism):
            raise RecordError(f"unknown evaluation mechanism {data['mechanism']!r}")
        if isinstance(data["delta"], bool) or data["delta"] != 0:
            raise RecordError(f"an evaluation's δ is 0 (pure ε), got {data['delta']!r}")
        return cls(
            epsilon=positive_finite(data["epsilon"], "the evaluation ε"),
            n=positive_int(data["n"], TEST_ROWS),
            mechanism=EvaluationMechanism(data["mechanism"]),
        )


@dataclass(frozen=True)
class PrivateAccuracy:
    """A published test-accuracy estimate and the guarantee its test rows have: ε-DP
    (δ = 0) by ``mechanism`` with sensitivity 1/``n`` (see the module docstring)."""

    value: float
    epsilon: float
    n: int
    mechanism: EvaluationMechanism = EvaluationMechanism.LAPLACE
    delta: float = 0.0

    @property
    def evaluation(self) -> Evaluation:
        """What this estimate spent on its test rows (the ledger's record)."""
        return Evaluation(self.epsilon, self.n, self.mechanism, self.delta)

    @property
    def scale(self) -> float:
        """The Laplace scale b = sensitivity/ε = 1/(n·ε)."""
        return 1.0 / (self.n * self.epsilon)

    def metrics(self) -> dict[str, Any]:
        """The release's test metrics: the estimate, its guarantee and n_test (public)."""
        return {
            METRIC: self.value,
            "test_accuracy_epsilon": self.epsilon,
            "test_accuracy_delta": self.delta,
            "test_accuracy_mechanism": self.mechanism.value,
            "test_n": self.n,
        }

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any]) -> PrivateAccuracy | None:
        """The estimate a release's metrics carry; ``None`` when its test accuracy is not a
        private estimate (e.g. a merge evaluated outside a policy)."""
        if not all(key in metrics for key in (METRIC, "test_n", *PRIVACY_KEYS)):
            return None
        if metrics["test_accuracy_mechanism"] not in set(EvaluationMechanism):
            return None
        value = metrics[METRIC]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RecordError(f"{METRIC} must be a number, got {value!r}")
        return cls(
            value=float(value),
            epsilon=positive_finite(metrics["test_accuracy_epsilon"], "test_accuracy_epsilon"),
            n=positive_int(metrics["test_n"], TEST_ROWS),
            mechanism=EvaluationMechanism(metrics["test_accuracy_mechanism"]),
            delta=float(metrics["test_accuracy_delta"]),
        )


def laplace_noise(scale: float) -> float:
    """One Laplace(0, ``scale``) draw from the OS's generator: the difference of two
    independent exponentials of mean ``scale``."""
    system = random.SystemRandom()
    return scale * (system.expovariate(1.0) - system.expovariate(1.0))


def private_accuracy(accuracy: float, n: int, epsilon: float) -> PrivateAccuracy:
    """A fresh ε-DP estimate of ``accuracy`` measured on ``n`` test rows (a new noise draw:
    callers keep it once per release, :func:`dpmerge.policy_merge.draws.stored_accuracy`)."""
    epsilon = positive_finite(epsilon, "the evaluation ε")
    n = positive_int(n, TEST_ROWS)
    if isinstance(accuracy, bool) or not isinstance(accuracy, int | float):
        raise RecordError(f"an accuracy must be a number, got {accuracy!r}")
    if not 0 <= accuracy <= 1:
        raise RecordError(f"an accuracy must be within [0, 1], got {accuracy!r}")
    noisy = float(accuracy) + laplace_noise(1.0 / (n * epsilon))
    return PrivateAccuracy(min(1.0, max(0.0, noisy)), epsilon, n)
