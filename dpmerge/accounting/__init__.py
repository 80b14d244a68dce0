"""Privacy accounting for merging DP-SGD candidates (docs/design.md).

Describing a mechanism (``records``) is kept apart from analysing it (``pld``, ``rdp``, and the
RS/LC bounds built on them), as dp_accounting separates events from accountants. Names load on
first use: reading a record (a policy, a command's options) does not import dp_accounting.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PairBound": "dpmerge.accounting.bounds",
    "PrivacyReport": "dpmerge.accounting.bounds",
    "candidate_bound": "dpmerge.accounting.candidate",
    "dpsgd_epsilon_pld": "dpmerge.accounting.candidate",
    "noise_multiplier_for_epsilon": "dpmerge.accounting.candidate",
    "Candidate": "dpmerge.accounting.records",
    "MechanismRecord": "dpmerge.accounting.records",
    "PrivacyLabel": "dpmerge.accounting.records",
    "candidate_from_dict": "dpmerge.accounting.records",
    "candidates_to_document": "dpmerge.accounting.records",
    "load_candidates": "dpmerge.accounting.records",
}
"""Public name → the module defining it."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dpmerge.accounting' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
