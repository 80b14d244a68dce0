"""A merged model directory on its way into the registry: its checks, the release's hash, its two
privacy cards, the ``dp.*`` tags, the run params and the merge record. No MLflow calls.

What MLflow receives is public — a consumer of the release may read it
(docs/design.md#release-state): the public card, the guarantee's tags, the test accuracy, and a
merge record of the method and counts only. The candidates' versions, their records (keyed
dataset identifier and keyed lineages, never a fingerprint or seed: :mod:`dpmerge.publication`),
the weights or rungs, the full privacy report and the internal card form the release's internal
record (:meth:`MergedRelease.internal`), which the workflow keeps in the release-state store.
Neither ever holds the RS draw."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpmerge.accounting.delta import delta_check_for
from dpmerge.accounting.private_accuracy import PrivateAccuracy
from dpmerge.accounting.private_selection import Selection
from dpmerge.accounting.records import Candidate, candidate_from_dict
from dpmerge.artifacts import ModelDir, load_model_dir
from dpmerge.keys import WorkflowKey
from dpmerge.privacy_card import CardCandidate, PrivacyCard, build_privacy_card
from dpmerge.public_card import build_public_card
from dpmerge.publication import public_record
from dpmerge.registry.errors import RegistryError
from dpmerge.registry.names import release_hash
from dpmerge.registry.tags import ROLE_MERGED, tag_values

INTERNAL_MERGE_KEYS = ("method", "weights", "rungs", "bound", "calibration")
PUBLIC_POLICY_KEYS = (
    "name",
    "target_epsilon",
    "target_delta",
    "method",
    "tune_weights",
    "tune",
    "selection_epsilon",
)


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
        selection = Selection.from_metrics(self.loaded.metrics)
        return release_hash(
            parent_model=parent_model,
            parents=[versions[n] for n in self.names],
            report=self.report,
            selection=None if selection is None else selection.metrics(),
        )

    @property
    def tuned(self) -> bool:
        """Whether validation accuracy tuned the LC weights (the policy's ``tune_weights``;
        RS has no weights to tune)."""
        return bool(self.policy.get("tune_weights")) and self.report["method"] != "rs"

    def internal_card(
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
            tuned=self.tuned,
        )

    @property
    def public_metrics(self) -> dict[str, Any]:
        """The release's metrics a consumer may read: every one but a validation split's (a
        tuned release's validation accuracy and count are of rows its guarantee does not
        cover, docs/design.md#row-protection)."""
        return {k: v for k, v in self.loaded.metrics.items() if not k.startswith("validation")}

    def public_card(
        self, name: str, ledger: Mapping[str, Any] | None, notes: Sequence[str] = ()
    ) -> PrivacyCard:
        records = [record for record, _ in self.records]
        return build_public_card(
            self.report,
            target_epsilon=self.target_epsilon,
            target_delta=self.target_delta,
            model_name=name,
            policy_id=self.policy_id,
            ledger=ledger,
            metrics=self.public_metrics,
            notes=notes,
            tuned=self.tuned,
            delta_warning=delta_check_for(records, self.report["delta"]).warning,
        )

    def tags(self, accuracy: Mapping[str, Any]) -> dict[str, str]:
        """The version's ``dp.*`` tags (public: the guarantee, never a candidate);
        ``accuracy``: the ``dp.accuracy`` tags."""
        report = self.report
        bounds = report.get("bounds", {})
        generic, structured = bounds.get("generic") or {}, bounds.get("structured") or {}
        return tag_values(
            {
                "dp.role": ROLE_MERGED,
                "dp.method": report["method"],
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

    def params(self) -> dict[str, Any]:
        """The run's params: the method, bound, δ and the public fields of the policy."""
        report = self.report
        policy = {k: self.policy[k] for k in PUBLIC_POLICY_KEYS if k in self.policy}
        return {
            "method": report["method"],
            "bound": report["bound"],
            "delta": report["delta"],
            "policy": json.dumps(policy, sort_keys=True, default=str),
        }

    def public_record(self) -> bytes:
        """The record file stored with the version: the method, its gating bound and how many
        candidates (and merges) it combined."""
        report = self.report
        merge = {
            "method": report["method"],
            "bound": report["bound"],
            "delta": report["delta"],
            "candidates": len(report.get("used_candidates") or report["candidates"]),
        }
        if report.get("rungs"):
            merge["merges"] = len(report["rungs"])
        return json.dumps({"merge": merge}, indent=2).encode()

    def internal_record(self) -> dict[str, Any]:
        """The merge record as the internal record keeps it: method, weights or rungs, bound,
        calibration, and each candidate's record as published with its own bound."""
        internal = {k: self.merge[k] for k in INTERNAL_MERGE_KEYS if k in self.merge}
        internal["candidates"] = [
            {
                "record": record.model_dump(mode="json", exclude_none=True),
                **({"privacy": dict(privacy)} if privacy is not None else {}),
            }
            for record, privacy in self.records
        ]
        return internal


@dataclass(frozen=True)
class MergedRelease:
    """A merged directory checked and described for registration as ``name``: its parents
    (candidate name -> version of ``parent_model``), its identity and its two cards."""

    merged: MergedDir
    name: str
    parent_model: str
    versions: dict[str, str]
    content_hash: str
    public: PrivacyCard
    internal_card: PrivacyCard

    @property
    def parents(self) -> list[str]:
        """The candidate versions, in the report's order."""
        return [self.versions[n] for n in self.merged.names]

    def internal(self) -> dict[str, Any]:
        """The release's internal record (see the module docstring), with what its published
        accuracy estimate spent on the test rows, so a rebuilt ledger charges it
        (docs/design.md#release-ledger; private selections are kept beside it by
        :func:`dpmerge.state.releases.keep_selection`)."""
        merged = self.merged
        estimate = PrivateAccuracy.from_metrics(merged.public_metrics)
        return {
            **({"evaluation": estimate.evaluation.to_dict()} if estimate is not None else {}),
            "release": self.content_hash,
            "model": self.name,
            "dataset": merged.dataset,
            "parent_model": self.parent_model,
            "parents": self.parents,
            "candidates": merged.names,
            "used_candidates": list(merged.report.get("used_candidates") or merged.names),
            "method": merged.report["method"],
            "policy": dict(merged.policy),
            "report": merged.report,
            "merge": merged.internal_record(),
            "card": self.internal_card.markdown,
            "card_data": self.internal_card.data,
        }
