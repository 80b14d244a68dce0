"""dpmerge: differentially private model merging (README.md, docs/design.md).

The public API is small, in the spirit of Opacus' ``PrivacyEngine``: describe candidates,
account a merge, calibrate one to a target, merge model directories. Names are imported on
first use, so ``import dpmerge`` (and every ``--help``) stays fast.

>>> import dpmerge
>>> candidates = dpmerge.load_candidates("candidates.json")  # doctest: +SKIP
>>> plan = dpmerge.calibrate(candidates, "lc", 2.0, 1e-5)  # doctest: +SKIP
>>> dpmerge.merge(dirs, "lc", plan, "out/", delta=1e-5)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "MechanismRecord": "dpmerge.accounting.records",
    "PrivacyLabel": "dpmerge.accounting.records",
    "load_candidates": "dpmerge.accounting.records",
    "account": "dpmerge.accounting.account",
    "calibrate": "dpmerge.accounting.calibration",
    "release_units": "dpmerge.accounting.generic",
    "cumulative_bound": "dpmerge.accounting.ledger",
    "merge": "dpmerge.merging",
}
"""Public name → the module defining it (``merge`` is ``merging.merge_model_dirs``)."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dpmerge' has no attribute {name!r}")
    value = getattr(
        importlib.import_module(module), "merge_model_dirs" if name == "merge" else name
    )
    globals()[name] = value
    return value
