"""A merged model directory on its way into the registry: its checks, the release's hash, the
privacy card, the ``dp.*`` tags, the run params and the public merge record. No MLflow calls.
The merge record is reduced to its public keys, so no tag, param, card or artifact receives the
RS draw; the candidates' records in it, the card and the tags carry the keyed dataset
identifier and keyed lineages, never the training-data fingerprint or a seed
(:mod:`dpmerge.publication`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpmerge.accounting.records import Candidate, candidate_from_dict
from dpmerge.artifacts import ModelDir, load_model_dir
from dpmerge.keys import WorkflowKey
from dpmerge.privacy_card import CardCandidate, PrivacyCard, build_privacy_card
from dpmerge.publication import public_record
from dpmerge.registry.errors import RegistryError
from dpmerge.registry.names import release_hash
from dpmerge.registry.tags import ROLE_MERGED, tag_values

PUBLIC_MERGE_KEYS = ("method", "weights", "bound", "calibration")


@dataclass(frozen=True)
class MergedDir:
    """A merged directory checked for registration under ``policy`` (a mapping with numeric
    ``target_epsilon`` and ``target_delta``): its candidates' records and bounds in the order
    of ``privacy.json``."""

    loaded: ModelDir
    report: dict[str, Any]  # privacy.json
    merge: dict[str, Any]  # the merge record
    policy: Mapping[str, Any]
    target_epsilon: float
    target_delta: float
    records: tuple[tuple[Candidate, Mapping[str, Any] | None], ...]

    @classmethod
    def read(cls, model_dir: str | Path, policy: Mapping[str, Any], keys: WorkflowKey) -> MergedDir:
        loaded = load_model_dir(model_dir)
        if loaded.merge is None or loaded.privacy is None:
            raise RegistryError(f"{loaded.path} is not a merged model directory with privacy.json")
        report, merge = loaded.privacy, loaded.merge
        try:
            target_epsilon = float(policy["target_epsilon"])
            target_delta = float(policy["target_delta"])
        except (KeyError, TypeError, ValueError):
            raise RegistryError(
                "policy needs numeric 'target_epsilon' and 'target_delta'"
            ) from None
        records = tuple(
            (public_record(candidate_from_dict(entry["record"]), keys), entry.get("privacy"))
            for entry in merge.get("candidates", [])
            if isinstance(entry, Mapping) and "record" in entry
        )
        names = list(report.get("candidates", []))
        if [r.name for r, _ in records] != names:
            raise RegistryError(
                f"{loaded.path}: the merge record's candidates do not match privacy.json's {names}"
            )
        return cls(loaded, report, merge, policy, target_epsilon, target_delta, records)

    @property
    def names(self) -> list[str]:
        """The candidates' names, in the report's order."""
        return list(self.report.get("candidates", []))

    @property
    def dataset(self) -> str:
        """The published dataset identifier."""
        return self.records[0][0].dataset

    @property
    def policy_id(self) -> str | None:
        return str(self.policy.get("name") or self.policy.get("id") or "") or None

    def request_hash(self, parent_model: str, versions: Mapping[str, str]) -> str:
        """The release's identity; ``versions``: candidate name -> parent version."""
        report = self.report
        return release_hash(
            parent_model=parent_model,
            parents=[versions[n] for n in self.names],
            method=report["method"],
            weights=report["weights"],
            delta=report["delta"],
            bound=report["bound"],
        )

    def card(
        self,
        name: str,
        versions: Mapping[str, str],
        ledger: Mapping[str, Any] | None,
        notes: Sequence[str] = (),
    ) -> PrivacyCard:
        return build_privacy_card(
            self.report,
            target_epsilon=self.target_epsilon,
            target_delta=self.target_delta,
            candidates=[CardCandidate.from_record(r, p, versions[r.name]) for r, p in self.records],
            model_name=name,
            policy_id=self.policy_id,
            ledger=ledger,
            metrics=self.loaded.metrics,
            notes=notes,
        )

    def tags(
        self, parent_model: str, versions: Mapping[str, str], accuracy: Mapping[str, Any]
    ) -> dict[str, str]:
        """The version's ``dp.*`` tags; ``accuracy``: the ``dp.accuracy`` tags."""
        report = self.report
        bounds = report.get("bounds", {})
        generic, structured = bounds.get("generic") or {}, bounds.get("structured") or {}
        return tag_values(
            {
                "dp.role": ROLE_MERGED,
                "dp.method": report["method"],
                "dp.weights": json.dumps([float(w) for w in report["weights"]]),
                "dp.parents": ",".join(versions[n] for n in self.names),
                "dp.parent_model": parent_model,
                "dp.gating_bound": report["bound"],
                "dp.epsilon": report["epsilon"],
                "dp.delta": report["delta"],
                "dp.accountant": report.get("accountant"),
                "dp.epsilon_pld": report.get("epsilon_pld"),
                "dp.epsilon_rdp": report.get("epsilon_rdp"),
                "dp.generic_epsilon": generic.get("epsilon"),
                "dp.structured_epsilon": structured.get("epsilon"),
                "dp.neighbouring": report.get("neighbouring"),
                "dp.policy": self.policy_id,
                "dp.target_epsilon": self.target_epsilon,
                "dp.target_delta": self.target_delta,
                "dp.dataset": self.dataset,
                "dp.model": self.loaded.spec.name,
                **accuracy,
            }
        )

    def params(self, parent_model: str, tags: Mapping[str, str]) -> dict[str, Any]:
        """The run's params (``tags``: this version's, for parents and weights)."""
        report = self.report
        return {
            "method": report["method"],
            "bound": report["bound"],
            "delta": report["delta"],
            "parent_model": parent_model,
            "parents": tags["dp.parents"],
            "weights": tags["dp.weights"],
            "policy": json.dumps(dict(self.policy), sort_keys=True, default=str),
        }

    def public_record(self) -> bytes:
        """The record file stored with the version: the merge's public keys, and each
        candidate's record as published (keyed dataset identifier and lineages) with its own
        bound."""
        public = {k: self.merge[k] for k in PUBLIC_MERGE_KEYS if k in self.merge}
        public["candidates"] = [
            {
                "record": record.model_dump(mode="json", exclude_none=True),
                **({"privacy": dict(privacy)} if privacy is not None else {}),
            }
            for record, privacy in self.records
        ]
        return json.dumps({"merge": public}, indent=2).encode()
