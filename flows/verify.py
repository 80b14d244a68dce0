"""``verify-state``: find drift between MLflow and the release-state store and repair what is
safe to repair (``dpmerge.policy_merge.verify``, docs/design.md#release-state).

Scheduled (deployments/prefect.yaml) and run after every policy run for its dataset. Each
finding is logged, listed in the Markdown artifact ``state-verification`` and emitted as the
event ``dpmerge.drift.found`` (resource ``dpmerge.state.<kind>``), which an automation can turn
into an alert (docs/workflow.md#drift). A run with findings ends ``Failed`` named ``Drift`` —
even when they were repaired, someone changed what only the workflow should — and one without
ends ``Completed``.

With a stack, it also checks the work pools the stack provisioned (``$DPMERGE_LOCKED_POOLS``)
against their provisioned base job templates and sets a changed one back
(``pool_template_drift``, docs/stack.md#roles-and-permissions).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.objects import State
from prefect.events import emit_event
from prefect.states import Completed, Failed

from devstack.provision import pool_drift
from devstack.roles import LOCKED_POOLS_ENV
from dpmerge import policy_merge as pm
from dpmerge.policy_merge.verify import Finding, verify

FLOW_NAME = "verify-state"
EVENT = "dpmerge.drift.found"
DRIFT = "Drift"


def emit(findings: Sequence[Finding]) -> None:
    """Log each finding and emit it as ``dpmerge.drift.found``."""
    logger = get_run_logger()
    for finding in findings:
        logger.warning(finding.line())
        emit_event(
            event=EVENT,
            resource={
                "prefect.resource.id": f"dpmerge.state.{finding.kind.value}",
                "prefect.resource.name": finding.subject,
            },
            payload=finding.to_dict(),
        )


def report(findings: Sequence[Finding], where: str) -> State:
    """Log, publish and emit ``findings``; the run's final state."""
    emit(findings)
    lines = [f"# State verification: {len(findings)} finding(s)", "", where, ""]
    lines += [f"* {finding.line()}" for finding in findings]
    create_markdown_artifact(
        markdown="\n".join(lines), key="state-verification", description="dpmerge drift"
    )
    if findings:
        return Failed(name=DRIFT, message=f"{len(findings)} finding(s): {findings[0].line()}")
    return Completed(message=f"no drift ({where})")


def pool_findings(repair: bool) -> list[Finding]:
    """A finding for each pool of ``$DPMERGE_LOCKED_POOLS`` whose base job template is not
    the provisioned one, set back with ``repair`` (none without the variable: no stack)."""
    pools = [pool for pool in os.environ.get(LOCKED_POOLS_ENV, "").split(",") if pool]
    if not pools:
        return []
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL

    return pool_drift(
        str(PREFECT_API_URL.value()), str(PREFECT_API_AUTH_STRING.value()), pools, repair=repair
    )


@flow(name=FLOW_NAME, persist_result=False)
def verify_state(repair: bool = True) -> State:
    """Compare MLflow with the release-state store and the signatures; with ``repair``, repair
    what is safe to repair (see the module docstring)."""
    workspace = pm.Workspace.from_env()
    findings = verify(workspace, repair=repair) + pool_findings(repair)
    return report(findings, f"registry {workspace.tracking_uri}, state {workspace.state().where}")
