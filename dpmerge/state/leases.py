"""Per-policy leases: one run works on a policy at a time, and a holder that dies loses its
lease within :data:`TTL` (docs/design.md#release-state).

A lease is ``leases/<policy>.json`` (holder, expiry), taken by compare-and-swap when it is free
or expired, renewed by a background thread every :data:`RENEW_EVERY`, and released on exit.
It saves work only: correctness never depends on it — every state transition is itself a
compare-and-swap that refuses a stale run (a later policy version, another owner). Expiry
compares wall clocks of different hosts, so their clocks must agree to well within the TTL.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime, timedelta
from typing import Any

from dpmerge.errors import DPMergeError
from dpmerge.state.store import StateStore, now, stamp

TTL = timedelta(seconds=30)
RENEW_EVERY = 10.0
POLL_S = 0.5


class LeaseTimeoutError(TimeoutError):
    """The lease stayed taken by a live holder for longer than the caller would wait."""


def holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


def _free(document: dict[str, Any] | None, holder: str) -> bool:
    if document is None or document.get("holder") in (None, holder):
        return True
    try:
        return datetime.fromisoformat(str(document["expires"])) <= now()
    except (KeyError, ValueError):
        return True  # an unreadable lease is nobody's


def _take(store: StateStore, key: str, holder: str, ttl: timedelta) -> bool:
    """Take or renew the lease if it is free for ``holder``; whether this call did."""

    def change(document: dict[str, Any] | None) -> tuple[dict[str, Any] | None, bool]:
        if not _free(document, holder):
            return None, False
        return {"holder": holder, "expires": stamp(now() + ttl), "renewed": stamp()}, True

    return store.update(key, change, signed=False)


def _release(store: StateStore, key: str, holder: str) -> None:
    def change(document: dict[str, Any] | None) -> tuple[dict[str, Any] | None, None]:
        if document is None or document.get("holder") != holder:
            return None, None
        return {"holder": None, "expires": stamp(), "released": stamp()}, None

    store.update(key, change, signed=False)


@contextmanager
def lease(store: StateStore, policy: str, timeout_s: float, ttl: timedelta = TTL) -> Iterator[str]:
    """Hold ``policy``'s lease for the block (waiting up to ``timeout_s`` for a live holder;
    :class:`LeaseTimeoutError` after); yields the holder id."""
    key = f"leases/{policy}.json"
    holder = holder_id()
    deadline = time.monotonic() + timeout_s
    while not _take(store, key, holder, ttl):
        if time.monotonic() > deadline:
            raise LeaseTimeoutError(
                f"policy {policy}: another run held its lease for {timeout_s:g} s"
            )
        time.sleep(POLL_S)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(RENEW_EVERY):
            # a failed renewal only risks another run starting on the policy: every
            # transition refuses a stale run by itself, so it is retried, not raised
            with suppress(DPMergeError, OSError):
                _take(store, key, holder, ttl)

    renewer = threading.Thread(target=renew, name=f"lease-{policy}", daemon=True)
    renewer.start()
    try:
        yield holder
    finally:
        stop.set()
        renewer.join()
        _release(store, key, holder)
