"""Random selection: release θ_I with I ~ π (docs/design.md#random-selection).

Both bounds need no independence between candidates, so RS is valid for checkpoints of one run,
for candidates that share batches or a noise stream, and for label-only candidates:

* PLD: δ_RS(ε) = Σ_i π_i·δ_i(ε) per adjacency direction (joint convexity of the hockey-stick
  divergence); ε at δ* in closed form (``profiles.mixture_epsilon``).
* RDP: ε_RS(α) = (1/(α−1))·log Σ_i π_i·exp((α−1)·ε_i(α)), evaluated with logsumexp.

The mixed items are usually candidates, but any mechanisms with a PLD and an RDP curve can be
mixed: the ``mixture`` method mixes LC merges of two subsets (their curves being the
composition of their release units, ``dpmerge.accounting.mixture``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from scipy.special import logsumexp

from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting import profiles
from dpmerge.accounting import rdp as rdp_mod
from dpmerge.accounting.bounds import PairBound, bound_from_curves
from dpmerge.accounting.records import Candidate, MechanismRecord
from dpmerge.vocabulary import BoundKind

SECRET_INDEX = (
    "the drawn index is secret: one cryptographic draw, never released (docs/design.md#rs-secrecy)"
)


def rs_rdp_curve(curves: Sequence[Sequence[float]], weights: Sequence[float]) -> np.ndarray:
    """RDP curve of the π-mixture: (1/(α−1))·LSE_i(log π_i + (α−1)·ε_i(α))."""
    orders = np.asarray(rdp_mod.ORDERS)
    w = np.asarray(weights, float)
    used = w > 0
    scaled = (orders - 1)[None, :] * np.asarray(curves, float)[used]
    with np.errstate(invalid="ignore"):  # inf·0 cannot occur: orders > 1
        total = logsumexp(scaled, axis=0, b=w[used][:, None])
    return total / (orders - 1)


def mixture_bound(
    weights: Sequence[float],
    plds: Sequence[Callable[[], pld_mod.PLD]],
    curves: Sequence[Callable[[], Sequence[float]]],
    delta: float,
    discretisation: float,
    assumptions: tuple[str, ...] = (),
    *,
    kind: BoundKind = BoundKind.SELECTION,
) -> PairBound:
    """ε of releasing item I ~ π = ``weights`` (``kind``: ``selection`` for candidates,
    ``mixture`` for LC merges); items given lazily by their PLD and RDP curve, evaluated only
    where π_i > 0."""
    used = [i for i, w in enumerate(weights) if w > 0]
    pi = [weights[i] for i in used]
    return bound_from_curves(
        kind,
        delta,
        pld=lambda: profiles.mixture_epsilon([plds[i]() for i in used], pi, delta),
        rdp=lambda: rs_rdp_curve([curves[i]() for i in used], pi),
        discretisation=discretisation,
        assumptions=(*assumptions, SECRET_INDEX),
    )


def rs_bound(
    candidates: Sequence[Candidate],
    weights: Sequence[float],
    delta: float,
    discretisation: float = pld_mod.FINE_DISCRETISATION,
) -> PairBound:
    """ε of releasing candidate θ_I, I ~ π = ``weights``, under PLD and RDP."""
    labels = tuple(
        f"privacy label of {c.name!r} taken as given (training unknown)"
        for w, c in zip(weights, candidates, strict=True)
        if w > 0 and not isinstance(c, MechanismRecord)
    )
    return mixture_bound(
        weights,
        [lambda c=c: pld_mod.candidate_pld(c, discretisation) for c in candidates],
        [lambda c=c: rdp_mod.candidate_rdp(c) for c in candidates],
        delta,
        discretisation,
        labels,
    )
