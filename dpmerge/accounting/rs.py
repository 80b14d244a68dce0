"""Random selection: release θ_I with I ~ π (SPEC §4).

Both bounds need no independence between candidates, so RS is valid for checkpoints of one run
and for label-only candidates:

* PLD: δ_RS(ε) = Σ_i π_i·δ_i(ε) per adjacency direction (joint convexity of the hockey-stick
  divergence); ε at δ* in closed form (``profiles.mixture_epsilon``).
* RDP: ε_RS(α) = (1/(α−1))·log Σ_i π_i·exp((α−1)·ε_i(α)), evaluated with logsumexp.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.special import logsumexp

from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting import profiles
from dpmerge.accounting import rdp as rdp_mod
from dpmerge.accounting.bounds import PairBound
from dpmerge.accounting.records import Candidate, MechanismRecord

SECRET_INDEX = "the drawn index is secret: one cryptographic draw, never released (SPEC §4)"


def rs_rdp_curve(curves: Sequence[Sequence[float]], weights: Sequence[float]) -> np.ndarray:
    """RDP curve of the π-mixture: (1/(α−1))·LSE_i(log π_i + (α−1)·ε_i(α))."""
    orders = np.asarray(rdp_mod.ORDERS)
    w = np.asarray(weights, float)
    used = w > 0
    scaled = (orders - 1)[None, :] * np.asarray(curves, float)[used]
    with np.errstate(invalid="ignore"):  # inf·0 cannot occur: orders > 1
        total = logsumexp(scaled, axis=0, b=w[used][:, None])
    return total / (orders - 1)


def rs_bound(
    candidates: Sequence[Candidate],
    weights: Sequence[float],
    delta: float,
    discretisation: float = pld_mod.FINE_DISCRETISATION,
) -> PairBound:
    """ε of releasing θ_I, I ~ π = ``weights``, under PLD and RDP (kind ``"selection"``)."""
    used = [(w, c) for w, c in zip(weights, candidates, strict=True) if w > 0]
    reasons = []
    try:
        plds = [pld_mod.candidate_pld(c, discretisation) for _, c in used]
        epsilon_pld = profiles.mixture_epsilon(plds, [w for w, _ in used], delta)
    except ValueError:
        epsilon_pld = None
        reasons.append("PLD unavailable: a used candidate has only an RDP label")
    curves = [rdp_mod.candidate_rdp(c) for _, c in used]
    if any(curve is None for curve in curves):
        epsilon_rdp, order = None, None
        reasons.append("RDP unavailable: a used candidate has only an (ε, δ) label")
    else:
        epsilon_rdp, order = rdp_mod.epsilon_from_rdp(
            rs_rdp_curve(curves, [w for w, _ in used]), delta
        )
    assumptions = tuple(
        f"privacy label of {c.name!r} taken as given (training unknown)"
        for _, c in used
        if not isinstance(c, MechanismRecord)
    )
    return PairBound(
        kind="selection",
        delta=delta,
        epsilon_pld=epsilon_pld,
        epsilon_rdp=epsilon_rdp,
        rdp_order=order,
        discretisation=discretisation if epsilon_pld is not None else None,
        assumptions=(*assumptions, SECRET_INDEX),
        reason="; ".join(reasons) or None,
    )
