"""Prefect flows composing the tasks in ``tasks/`` (dependency direction: flows → tasks →
dpmerge)."""
