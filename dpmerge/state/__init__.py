"""The release-state store: the one door to the facts that decide what is served and what it
cost (docs/design.md#release-state), as :mod:`dpmerge.registry` is the door to MLflow.

Which store holds which fact:

* **here** (S3 bucket ``dpmerge-state`` on the stack, ``<home>/state/`` embedded): policies
  and every version of them (:mod:`~dpmerge.state.policies`), the outcome of each run and the
  flow run each version became; per dataset, one signed document holding the release ledger and
  every alias's owner and serving pointer (:mod:`~dpmerge.state.serving`); quarantined versions
  (:mod:`~dpmerge.state.quarantine`); per-policy leases (:mod:`~dpmerge.state.leases`); each
  release's internal record: its candidates, weights and internal card
  (:mod:`~dpmerge.state.releases`);
* **the audit bucket**: the RS draw of each release (``dpmerge.policy_merge.draws``);
* **MLflow**: models, their artifacts and public privacy cards, and the aliases — a
  *projection* of the serving pointers, moved after them and repaired from them (``dpmerge
  registry verify``).

Writes are create-once or compare-and-swap only (:mod:`~dpmerge.state.backend`).
"""

from dpmerge.state.backend import Backend, LocalBackend, S3Backend
from dpmerge.state.serving import (
    AliasOwnershipError,
    AliasState,
    CountedRelease,
    DatasetState,
    Guarantee,
    Served,
    SupersededError,
)
from dpmerge.state.store import StateConflictError, StateIntegrityError, StateStore

__all__ = [
    "AliasOwnershipError",
    "AliasState",
    "Backend",
    "CountedRelease",
    "DatasetState",
    "Guarantee",
    "LocalBackend",
    "S3Backend",
    "Served",
    "StateConflictError",
    "StateIntegrityError",
    "StateStore",
    "SupersededError",
]
