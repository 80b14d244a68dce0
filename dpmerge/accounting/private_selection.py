"""Private tuning's selection: the exponential mechanism on validation counts, sampled as
report-noisy-max with Gumbel noise (docs/design.md#private-tuning).

Each option j (a feasible merge) has a utility c_j: the number of validation rows it labels
correctly (for RS and the mixture, the expected number over the secret draw, Σ π_i·c_i). One
person holds one validation row. Under add-or-remove-one (the relation the records carry)
adding a row raises every c_j by 0 or 1 and removing one lowers every c_j by 0 or 1; under
replace-one every c_j moves by at most 1, in either direction. So the sensitivity is Δ = 1 under
both relations. The mechanism releases j with probability ∝ exp(ε·c_j/(2Δ)): ε-DP with δ = 0
under both relations, exactly (under add-or-remove-one, where the counts move together, it is
in fact ε/2-DP; ε is what is claimed). It is sampled without computing the probabilities: the
index of the largest c_j + (2Δ/ε)·G_j, with G_j independent standard Gumbel draws (the
Gumbel-max identity). The draw comes from the OS's cryptographic generator unless a study passes
a seeded one; the counts never leave the caller.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dpmerge.accounting.private_accuracy import positive_finite, positive_int
from dpmerge.errors import RecordError
from dpmerge.vocabulary import SelectionMechanism

SELECTION_EPSILON = 1.0
"""The default ε of the selection, spent on the validation rows once per release."""
METRIC_KEYS = ("epsilon", "delta", "mechanism", "n", "options")
KEY_PATTERN = re.compile(r"(selection-[0-9a-f]{40})?")
"""A selection's draw key (:func:`dpmerge.policy_merge.draws.selection_key`), or "" (none kept)."""
SENSITIVITY = 1.0
"""Δ of a count of correct validation predictions (see the module docstring)."""


@dataclass(frozen=True)
class Selection:
    """What a private selection spent on the validation rows, as the release ledger records
    it: ε-DP with δ = 0 by ``mechanism`` on ``n`` validation rows among ``options`` merges.
    ``key`` is the selection's draw key (docs/design.md#private-tuning): two selections that
    end in the same release are two charges, told apart by it ("" in records kept before
    keys were)."""

    epsilon: float
    n: int
    options: int
    mechanism: SelectionMechanism = SelectionMechanism.EXPONENTIAL
    delta: float = 0.0
    key: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "mechanism": self.mechanism.value,
            "n": self.n,
            "options": self.options,
        }
        return data | ({"key": self.key} if self.key else {})

    def metrics(self) -> dict[str, Any]:
        """The release's metrics that state the selection (the cards' validation row)."""
        data = self.to_dict()
        return {f"selection_{key}": data[key] for key in METRIC_KEYS}

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any]) -> Selection | None:
        """The selection a release's metrics state; ``None`` where it made none."""
        data = {k.removeprefix("selection_"): v for k, v in metrics.items()}
        if not all(f"selection_{key}" in metrics for key in METRIC_KEYS):
            return None
        return cls.from_dict({key: data[key] for key in METRIC_KEYS})

    @classmethod
    def from_dict(cls, data: Any) -> Selection:
        """Strict: exactly these five fields and an optional ``key``, ε finite and positive,
        δ = 0, a known mechanism, positive counts (:class:`RecordError` otherwise)."""
        if not isinstance(data, Mapping) or not set(METRIC_KEYS) <= set(data) <= {
            *METRIC_KEYS,
            "key",
        }:
            raise RecordError(
                "a selection record holds epsilon, delta, mechanism, n, options and optionally "
                f"key, got {data!r:.200}"
            )
        if data["mechanism"] not in set(SelectionMechanism):
            raise RecordError(f"unknown selection mechanism {data['mechanism']!r:.80}")
        if isinstance(data["delta"], bool) or data["delta"] != 0:
            raise RecordError(f"a selection's δ is 0 (pure ε), got {data['delta']!r:.80}")
        key = data.get("key", "")
        if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
            raise RecordError(f"a selection's key is selection-<40 hex digits>, got {key!r:.80}")
        return cls(
            epsilon=positive_finite(data["epsilon"], "the selection ε"),
            n=positive_int(data["n"], "the number of validation rows"),
            options=positive_int(data["options"], "the number of options"),
            mechanism=SelectionMechanism(data["mechanism"]),
            key=key,
        )


def _checked(counts: Sequence[float], epsilon: float) -> tuple[list[float], float]:
    epsilon = positive_finite(epsilon, "the selection ε")
    values = []
    for count in counts:
        if isinstance(count, bool) or not isinstance(count, int | float) or count < 0:
            raise RecordError(f"a validation count must be a non-negative number, got {count!r}")
        values.append(float(count))
    if not values:
        raise RecordError("a selection needs at least one option")
    return values, epsilon


def selection_probabilities(counts: Sequence[float], epsilon: float) -> list[float]:
    """The probability of each option: ∝ exp(ε·c_j/(2Δ)) (computed stably)."""
    values, epsilon = _checked(counts, epsilon)
    top = max(values)
    weights = [math.exp(epsilon * (c - top) / (2 * SENSITIVITY)) for c in values]
    total = sum(weights)
    return [w / total for w in weights]


def gumbel(rng: random.Random) -> float:
    """One standard Gumbel draw, −log(−log U) with U uniform on (0, 1)."""
    u = rng.random()
    while u <= 0.0:
        u = rng.random()
    return -math.log(-math.log(u))


def noisy_max(counts: Sequence[float], epsilon: float, rng: random.Random | None = None) -> int:
    """The index report-noisy-max releases: argmax of c_j + (2Δ/ε)·G_j, a draw from
    :func:`selection_probabilities` (``rng``: the OS's generator unless a study seeds one)."""
    values, epsilon = _checked(counts, epsilon)
    rng = rng or random.SystemRandom()
    scale = 2 * SENSITIVITY / epsilon
    noisy = [c + scale * gumbel(rng) for c in values]
    return max(range(len(noisy)), key=noisy.__getitem__)
