"""``verify-state``: find drift between MLflow and the release-state store and repair what is
safe to repair (``dpmerge.policy_merge.verify``, docs/design.md#release-state).

Scheduled (deployments/prefect.yaml) and run after every policy run for its dataset. Each
finding is logged, listed in the Markdown artifact ``state-verification`` and emitted as the
event ``dpmerge.drift.found`` (resource ``dpmerge.state.<kind>``), which an automation can turn
into an alert (docs/workflow.md#drift). A run with findings ends ``Failed`` named ``Drift`` —
even when they were repaired, someone changed what only the workflow should — and one without
ends ``Completed``.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.objects import State
from prefect.events import emit_event
from prefect.states import Completed, Failed

from dpmerge import policy_merge as pm
from dpmerge.policy_merge.verify import Finding, verify
from flows.runtime import load_workflow_secret

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


@flow(name=FLOW_NAME, persist_result=False)
def verify_state(repair: bool = True) -> State:
    """Compare MLflow with the release-state store and the signatures; with ``repair``, repair
    what is safe to repair (see the module docstring)."""
    load_workflow_secret()
    workspace = pm.Workspace.from_env()
    findings = verify(workspace, repair=repair)
    return report(findings, f"registry {workspace.tracking_uri}, state {workspace.state().where}")
