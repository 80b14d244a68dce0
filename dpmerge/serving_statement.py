"""The workflow's signed, expiring serving statement: what an alias serves, as consumers check
it (docs/design.md#security, "What is served is what the workflow serves").

Wherever the workflow projects an alias to MLflow (a policy run, ``verify-state``'s repair and
its re-issue every run) it also sets the registered-model tag ``dpmerge.signed.<alias>`` on the
releases model to a statement — alias, registered model, version, policy, policy version,
issued, expires (issued + :data:`TTL`), the signing key's fingerprint — signed with the
release-signing key (:func:`dpmerge.manifests.sign_text`). ``dpmerge verify`` of an alias
(and :meth:`~dpmerge.registry.Registry.load_verified`) refuses the version the alias resolves
to unless a statement for that alias verifies under the release public key, has not expired
(:data:`SKEW` of clock skew tolerated), names the same model and alias, and names that very
version: an alias moved to an older signed release, or to another policy's release, or a
workflow that stopped re-issuing (a frozen stack) is refused, as TUF's timestamp and snapshot
roles refuse rollback and freeze. (A release may serve several policies: the version, not the
release's ``dp.policy`` tag, is what is compared.)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta

from dpmerge import manifests
from dpmerge.errors import IntegrityError
from dpmerge.keys import WorkflowKey

SCHEMA = "dpmerge.serving-statement/1"
TTL = timedelta(minutes=30)
"""How long a statement is valid: six ``verify-state`` periods (every 5 minutes), so a few
missed runs do not refuse consumers, and a stack frozen for longer does."""
SKEW = timedelta(minutes=2)
"""The clock skew tolerated between the workflow's hosts and a consumer's."""


class ServingStatementError(IntegrityError):
    """An alias has no valid serving statement, or the one it has names another version."""


@dataclass(frozen=True)
class Statement:
    """What the workflow says an alias serves (see the module docstring); times ISO 8601 UTC."""

    alias: str
    model: str
    version: str
    policy: str
    policy_version: int
    issued: str
    expires: str
    key: str

    def text(self) -> str:
        """The canonical JSON that is signed."""
        return json.dumps({"schema": SCHEMA, **asdict(self)}, sort_keys=True, separators=(",", ":"))


def _now() -> datetime:
    return datetime.now(UTC)


def issue(
    model: str,
    alias: str,
    version: str,
    policy: str,
    policy_version: int,
    key: WorkflowKey,
    now: datetime | None = None,
) -> str:
    """The tag value of a statement that ``alias`` of ``model`` serves ``version`` of
    ``policy``, issued ``now`` (default: the clock) and signed with ``key``."""
    issued = now or _now()
    statement = Statement(
        alias,
        model,
        version,
        policy,
        policy_version,
        issued.isoformat(timespec="seconds"),
        (issued + TTL).isoformat(timespec="seconds"),
        manifests.fingerprint(manifests.public_key_hex(key)),
    )
    text = statement.text()
    return json.dumps({"statement": text, "signature": manifests.sign_text(text, key)})


def _read(value: str | None, subject: str, public_hex: str) -> Statement:
    if not value:
        raise ServingStatementError(
            f"{subject}: the workflow published no serving statement for this alias: do not "
            "serve it"
        )
    try:
        outer = json.loads(value)
        text, signature = str(outer["statement"]), str(outer["signature"])
    except (ValueError, KeyError, TypeError):
        raise ServingStatementError(f"{subject}: the serving statement cannot be read") from None
    if not manifests.signed_by(text, signature, public_hex):
        raise ServingStatementError(
            f"{subject}: the serving statement's signature does not verify under key "
            f"{manifests.fingerprint(public_hex)}: it was changed or not made by the workflow"
        )
    try:
        data = json.loads(text)
        if data.pop("schema") != SCHEMA:
            raise ValueError(data)
        return Statement(**data)
    except (ValueError, KeyError, TypeError):
        raise ServingStatementError(f"{subject}: the serving statement cannot be read") from None


def check(
    value: str | None,
    public_hex: str,
    *,
    model: str,
    alias: str,
    version: str,
    now: datetime | None = None,
) -> Statement:
    """The statement ``value`` (the tag) if it is valid for ``alias`` of ``model`` serving
    ``version`` at ``now`` (default: the clock);
    :class:`ServingStatementError` otherwise, in one line."""
    subject = f"{model}@{alias}"
    statement = _read(value, subject, public_hex)
    said = f"the workflow's statement (issued {statement.issued})"
    if (statement.model, statement.alias) != (model, alias):
        raise ServingStatementError(
            f"{subject}: {said} is for {statement.model}@{statement.alias}: do not serve it"
        )
    if (now or _now()) > datetime.fromisoformat(statement.expires) + SKEW:
        raise ServingStatementError(
            f"{subject}: {said} expired at {statement.expires}: the workflow has not confirmed "
            "what this alias serves since; do not serve it"
        )
    if statement.version != version:
        raise ServingStatementError(
            f"{subject}: the alias serves v{version} but {said} names v{statement.version} "
            f"(policy {statement.policy!r}, version {statement.policy_version}): an older or "
            "another policy's release; do not serve it"
        )
    return statement
