"""What of a candidate's record may be published, and the checks that keep a record honest
(docs/design.md#security, docs/design.md#sharp-edges).

* **Dataset identifier.** A record's ``dataset`` is a fingerprint of exactly the training rows:
  for an adversary who knows every other record it is a membership oracle. Everything
  published — registered-model names, ``dp.dataset`` tags, run params and dataset inputs, the
  public merge record — carries :func:`dataset_id` instead: ``<name>-hmac:<32 hex>``, a keyed
  hash nobody without the workflow's key can recompute. The fingerprint stays in the candidate's
  own (internal) record, where the evaluation split is found by it.
* **Lineages.** A fixed ``--noise-seed`` or ``--batch-seed`` shows in the lineage
  (``noise-seed-<s>``, ``poisson-seed-<s>/…``), and the generators' seeds derive from it: public
  noise voids the Gaussian mechanism. Published lineages and run ids are keyed hashes
  (:func:`lineage_id`): equal lineages stay equal, so the release units stay visible, and no
  seed shows. Policy merges refuse fixed-seed candidates outright (:func:`fixed_seed_streams`).
* **Signatures.** A candidate's record lives in a writable artifact store, so its registration
  signs the candidate's content hash (weights, architecture and record files) and its record
  as published with the workflow's Ed25519 key (``dpmerge.manifests``); a merge verifies it
  before it trusts the record.
"""

from __future__ import annotations

from dpmerge.accounting.records import Candidate, MechanismRecord
from dpmerge.keys import WorkflowKey
from dpmerge.vocabulary import KeyPurpose

FINGERPRINT_MARK = "-sha256:"
DATASET_ID_MARK = "-hmac:"
LINEAGE_ID_PREFIX = "lineage-hmac:"
FIXED_NOISE_PREFIX = "noise-seed-"
FIXED_BATCH_PREFIX = "poisson-seed-"
"""Lineage prefixes training writes for a user-given seed (``dpmerge.training``: ``noise-seed-s``,
``poisson-seed-s/n-…/q-…``); a secret OS seed gives ``run-<id>/…-fresh`` instead."""


def dataset_name(dataset: str) -> str:
    """The dataset's name in a fingerprint or identifier (``fashion-mnist-sha256:…`` →
    ``fashion-mnist``)."""
    for mark in (FINGERPRINT_MARK, DATASET_ID_MARK):
        if mark in dataset:
            return dataset.split(mark, 1)[0]
    return dataset.split(":", 1)[0]


def is_dataset_id(dataset: str) -> bool:
    return DATASET_ID_MARK in dataset


def dataset_id(dataset: str, key: WorkflowKey) -> str:
    """The published identifier of the training data named by ``dataset`` (a fingerprint):
    ``<name>-hmac:<32 hex>``. An identifier passes through unchanged."""
    if is_dataset_id(dataset):
        return dataset
    digest = key.mac(KeyPurpose.DATASET_ID, dataset)[:32]
    return f"{dataset_name(dataset)}{DATASET_ID_MARK}{digest}"


def lineage_id(lineage: str, key: WorkflowKey) -> str:
    """The published form of a lineage or run id: a keyed hash (equal in, equal out)."""
    if lineage.startswith(LINEAGE_ID_PREFIX):
        return lineage
    return LINEAGE_ID_PREFIX + key.mac(KeyPurpose.LINEAGE_ID, lineage)[:24]


def public_record(record: Candidate, key: WorkflowKey) -> Candidate:
    """``record`` as it may be published: dataset, lineages and run id keyed-hashed; the
    numbers the accountants need unchanged (so every bound computed from it is the same)."""
    changes: dict[str, str] = {"dataset": dataset_id(record.dataset, key)}
    if isinstance(record, MechanismRecord):
        changes["noise_lineage"] = lineage_id(record.noise_lineage, key)
        changes["batch_lineage"] = lineage_id(record.batch_lineage, key)
        if record.run_id is not None:
            changes["run_id"] = lineage_id(record.run_id, key)
    return record.model_copy(update=changes)


def fixed_seed_streams(record: Candidate) -> tuple[str, ...]:
    """The random streams of ``record`` that came from a user-given (hence not secret) seed:
    ``noise``, ``batches``, both or none. A label has none it could tell."""
    if not isinstance(record, MechanismRecord):
        return ()
    streams = []
    if record.noise_lineage.startswith(FIXED_NOISE_PREFIX):
        streams.append("noise")
    if record.batch_lineage.startswith(FIXED_BATCH_PREFIX):
        streams.append("batches")
    return tuple(streams)
