"""The noise and batch streams of a run: their generator seeds and lineages
(docs/design.md#mechanism-record, docs/design.md#structured-bound).

Each stream is its own generator seeded through a domain-separated hash, so equal user seeds
for noise and batches never give correlated streams:

* noise (``noise_seed``): lineage ``noise-seed-<seed>``; every run given the same seed shares
  the lineage, since it reuses the noise stream. ``None`` draws a secret seed from the OS (a
  fresh lineage ``run-<id>/noise-fresh``). A fixed seed makes the noise reproducible by whoever
  knows it: use ``None`` for releases.
* batches (``batch_seed``): lineage ``poisson-seed-<seed>/n-<n>/q-<q>``, plus the engine's
  sampler suffix where its sampler turns a seed into other batches than Opacus' does
  (``…/binomial-subset``); candidates with the same batch seed, engine, data and q draw
  identical Poisson batches (shared sampling). ``None`` draws a secret seed (independent
  sampling, lineage ``run-<id>/batches-fresh``).
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass


def stream_seed(label: str) -> int:
    """A 63-bit generator seed from a label (domain separation between random streams)."""
    return int.from_bytes(hashlib.sha256(label.encode()).digest()[:8], "big") >> 1


@dataclass(frozen=True)
class Streams:
    """A new run's id, its lineages and the seeds of its noise and batch generators."""

    run_id: str
    noise_lineage: str
    batch_lineage: str
    noise_seed: int
    batch_seed: int


def new_streams(
    noise_seed: int | None,
    batch_seed: int | None,
    *,
    dataset_size: int,
    sample_rate: float,
    sampler_id: str | None,
) -> Streams:
    """The streams of a new run; ``sampler_id`` names a sampler other than Opacus'."""
    run_id = uuid.uuid4().hex
    if noise_seed is None:
        noise_lineage, noise = f"run-{run_id}/noise-fresh", secrets.randbits(63)
    else:
        noise_lineage = f"noise-seed-{noise_seed}"
        noise = stream_seed(f"dpmerge/noise/{noise_seed}")
    if batch_seed is None:
        batch_lineage, batches = f"run-{run_id}/batches-fresh", secrets.randbits(63)
    else:
        batch_lineage = f"poisson-seed-{batch_seed}/n-{dataset_size}/q-{sample_rate!r}"
        if sampler_id is not None:
            batch_lineage += f"/{sampler_id}"
        batches = stream_seed(f"dpmerge/batches/{batch_lineage}")
    return Streams(run_id, noise_lineage, batch_lineage, noise, batches)
