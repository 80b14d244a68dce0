"""The mechanism record of a run, filled from what the engine actually ran, never from the
request (docs/design.md#mechanism-record): q is the sampler's own rate, the divisor is
``int(n·q)``, and the steps and σ are checked against the engine's accountant history. The
run's id goes into the record: only records that share it are ever treated as checkpoints of one
run (docs/design.md#release-units).
"""

from __future__ import annotations

from dataclasses import dataclass

from opacus.accountants import RDPAccountant

from dpmerge.accounting.records import MechanismRecord
from dpmerge.data import DatasetSplits
from dpmerge.training.checkpoint import RunState
from dpmerge.training.plan import MechanismPlan
from dpmerge.vocabulary import Neighbouring, Optimizer, Sampling

AccountantHistory = tuple[tuple[float, float, int], ...]
"""An RDP accountant's ``(σ, q, steps)`` entries."""


def accountant_history(accountant: RDPAccountant) -> AccountantHistory:
    return tuple((float(s), float(q), int(t)) for s, q, t in accountant.history)


@dataclass(frozen=True)
class Ran:
    """What an engine ran, read off its own optimizer, sampler and accountant."""

    noise_multiplier: float
    sample_rate: float
    clip_norm: float
    learning_rate: float
    expected_batch_size: float
    history: AccountantHistory


def mechanism_record(
    name: str,
    ran: Ran,
    plan: MechanismPlan,
    state: RunState,
    data: DatasetSplits,
    initialisation: str,
) -> MechanismRecord:
    """The record of ``ran``, after checking it against the plan and the steps counted."""
    history = ran.history
    steps = sum(t for _, _, t in history)
    if steps != state.step or any(s != ran.noise_multiplier for s, _, _ in history):
        raise RuntimeError(f"accountant history {history} disagrees with {state.step} steps run")
    if (ran.noise_multiplier, ran.sample_rate) != (plan.noise_multiplier, plan.sample_rate):
        raise RuntimeError(
            f"the engine ran σ = {ran.noise_multiplier}, q = {ran.sample_rate}; "
            f"planned σ = {plan.noise_multiplier}, q = {plan.sample_rate}"
        )
    return MechanismRecord(
        name=name,
        noise_multiplier=ran.noise_multiplier,
        sample_rate=ran.sample_rate,
        steps=steps,
        clip_norm=ran.clip_norm,
        learning_rate=ran.learning_rate,
        expected_batch_size=ran.expected_batch_size,
        optimizer=Optimizer.SGD,
        noise_lineage=state.noise_lineage,
        batch_lineage=state.batch_lineage,
        dataset=data.fingerprint,
        neighbouring=Neighbouring.ADD_OR_REMOVE_ONE,
        sampling=Sampling.POISSON,
        dataset_size=data.dataset_size,
        initialisation=initialisation,
        run_id=state.run_id,
    )
