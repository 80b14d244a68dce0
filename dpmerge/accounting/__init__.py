"""Privacy accounting for merging DP-SGD candidates (docs/design.md).

Describing a mechanism (``records``) is kept apart from analysing it (``pld``, ``rdp``, and the
RS/LC bounds built on them), as dp_accounting separates events from accountants.
"""

from dpmerge.accounting.bounds import PairBound, PrivacyReport
from dpmerge.accounting.candidate import (
    candidate_bound,
    dpsgd_epsilon_pld,
    noise_multiplier_for_epsilon,
)
from dpmerge.accounting.records import (
    Candidate,
    MechanismRecord,
    PrivacyLabel,
    candidate_from_dict,
    candidates_to_document,
    load_candidates,
)

__all__ = [
    "Candidate",
    "MechanismRecord",
    "PairBound",
    "PrivacyLabel",
    "PrivacyReport",
    "candidate_bound",
    "candidate_from_dict",
    "candidates_to_document",
    "dpsgd_epsilon_pld",
    "load_candidates",
    "noise_multiplier_for_epsilon",
]
