"""Privacy profiles of mechanisms other than dpmerge's DP-SGD: an RDP curve or an ε(δ) curve,
checked for self-contradiction and turned into a :class:`PrivacyLabel`
(docs/design.md#imported-candidates).

* An RDP curve (orders α → ε_α) becomes an RDP label. The generic bound composes labels by
  adding their curves at each order of :data:`dpmerge.accounting.rdp.ORDERS` (orders the curve
  does not list count as +∞, no claim) and converts with the standard RDP → (ε, δ) conversion;
  RS and the mixture read the same curve. A Rényi divergence is non-decreasing in α, so a curve
  that falls is a contradiction, as is a negative or non-finite value.
* An ε(δ) curve (pairs the mechanism satisfies) becomes the (ε, δ) label of its smallest δ:
  every pair of a valid curve holds, so this one is a true guarantee, and its worst-case PLD
  (dp_accounting's ``from_privacy_parameters``) composes soundly. The other pairs are kept in
  the attestation only. ε must not increase with δ.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

from pydantic import ValidationError

from dpmerge.accounting.records import PrivacyLabel
from dpmerge.documents import describe_validation_error
from dpmerge.errors import RecordError


def _numbers(values: Any, field: str, where: str) -> tuple[float, ...]:
    """A non-empty list of finite numbers (a boolean is not a number)."""
    if not isinstance(values, Sequence) or isinstance(values, str) or not values:
        raise RecordError(f"{where}: {field!r} must be a non-empty list of numbers")
    out = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RecordError(f"{where}: {field}[{i}] is not a number: {value!r}")
        if not math.isfinite(value):
            raise RecordError(f"{where}: {field}[{i}] is not finite: {value!r}")
        out.append(float(value))
    return tuple(out)


def _label(where: str, **fields: Any) -> PrivacyLabel:
    try:
        return PrivacyLabel.model_validate(fields)
    except ValidationError as error:
        raise RecordError(describe_validation_error(where, error, PrivacyLabel)) from None


def rdp_label(
    curve: Mapping[str, Any],
    *,
    name: str,
    dataset: str,
    attested_by: str,
    initialisation: str | None,
) -> PrivacyLabel:
    """The RDP label of ``{"orders": [...], "epsilons": [...]}``; a contradiction is refused."""
    where = f"RDP profile of {name!r}"
    orders = _numbers(curve.get("orders"), "orders", where)
    epsilons = _numbers(curve.get("epsilons"), "epsilons", where)
    if len(orders) != len(epsilons):
        raise RecordError(f"{where}: {len(orders)} orders but {len(epsilons)} epsilons")
    if any(e < 0 for e in epsilons):
        raise RecordError(f"{where}: an RDP ε_α is negative, which no mechanism has")
    ranked = sorted(zip(orders, epsilons, strict=True))
    for (a, ea), (b, eb) in pairwise(ranked):
        if eb < ea:
            raise RecordError(
                f"{where}: ε_α falls from {ea:g} at α = {a:g} to {eb:g} at α = {b:g}; a Rényi "
                "divergence is non-decreasing in α"
            )
    return _label(
        where,
        name=name,
        dataset=dataset,
        rdp_orders=orders,
        rdp_epsilons=epsilons,
        attested_by=attested_by,
        initialisation=initialisation,
    )


def epsilon_delta_label(
    curve: Mapping[str, Any],
    *,
    name: str,
    dataset: str,
    attested_by: str,
    initialisation: str | None,
) -> PrivacyLabel:
    """The (ε, δ) label of ``{"epsilons": [...], "deltas": [...]}`` at its smallest δ."""
    where = f"ε(δ) profile of {name!r}"
    epsilons = _numbers(curve.get("epsilons"), "epsilons", where)
    deltas = _numbers(curve.get("deltas"), "deltas", where)
    if len(epsilons) != len(deltas):
        raise RecordError(f"{where}: {len(epsilons)} epsilons but {len(deltas)} deltas")
    if any(not 0 < d < 1 for d in deltas):
        raise RecordError(f"{where}: every δ must lie in (0, 1)")
    if len(set(deltas)) != len(deltas):
        raise RecordError(f"{where}: each δ may appear once")
    ranked = sorted(zip(deltas, epsilons, strict=True))
    for (d1, e1), (d2, e2) in pairwise(ranked):
        if e2 > e1:
            raise RecordError(
                f"{where}: ε rises from {e1:g} at δ = {d1:g} to {e2:g} at δ = {d2:g}; ε(δ) "
                "must not increase with δ"
            )
    delta, epsilon = ranked[0]
    return _label(
        where,
        name=name,
        dataset=dataset,
        epsilon=epsilon,
        delta=delta,
        attested_by=attested_by,
        initialisation=initialisation,
    )
