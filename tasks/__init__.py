"""Thin Prefect tasks over dpmerge library calls: retries, logging, coarse granularity.

Tasks hold no logic of their own: each wraps one library step (``dpmerge.policy_merge``,
``dpmerge.training``, ``dpmerge.registry``, ``dpmerge.studies.frontier``). Registry and S3
steps retry on transient errors only (``dpmerge.errors.is_transient``: what the registry and
storage adapters raised as ``TransientError``); nothing that draws randomness (training, the RS
merge) is retried. Results are never persisted and inputs never
hashed (``NO_CACHE``): the merge step's inputs and outputs stay in the flow-run process.
"""
