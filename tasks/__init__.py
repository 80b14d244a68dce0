"""Thin Prefect tasks over dpmerge library calls: retries, logging, coarse granularity."""
