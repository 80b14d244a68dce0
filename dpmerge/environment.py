"""Process settings every layer shares: the telemetry switches, MLflow's quiet mode, and the one
HTTP probe that tells whether a server answers (docs/design.md#workflow).

The dev stack's health waits, the workflow's Prefect server check and the tests all call
:func:`probe`; nothing else in the repository opens a URL to ask "are you up?".
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

TELEMETRY_OFF = MappingProxyType(
    {"MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
)
"""No usage reports from MLflow or the Prefect server (the machines here are offline)."""

QUIET = MappingProxyType(
    {
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    }
)
"""No progress bars and no "View run … at …" lines from MLflow clients on stdout."""


@dataclass(frozen=True)
class Probe:
    """One HTTP answer: ``status`` is ``None`` when nothing answered (``error`` says why);
    ``body`` is the decoded JSON where the answer is JSON, else its text."""

    url: str
    status: int | None
    body: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def probe(
    url: str,
    *,
    method: str = "GET",
    body: Any = None,
    timeout_s: float = 2.0,
    headers: Mapping[str, str] | None = None,
) -> Probe:
    """Send one request (``body`` as JSON, ``headers`` e.g. a server's ``Authorization``) and
    report the answer; never raises for a server that is down, slow or answering an error
    status."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        return Probe(url, error.code, _decode(error.read()), f"HTTP {error.code}")
    except (urllib.error.URLError, OSError, ValueError) as error:
        return Probe(url, None, None, str(getattr(error, "reason", error)))
    return Probe(url, status, _decode(raw))


def _decode(raw: bytes) -> Any:
    text = raw.decode(errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
