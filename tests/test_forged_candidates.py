"""``dpmerge registry verify`` reports a forged candidate (issue 28, "other things"): a ready
candidate version whose signed record does not verify — a signed fact changed by an MLflow
writer, or a version planted unsigned — is a ``candidate_forged`` finding (exit 1) naming the
quarantine that repairs it; a quarantined one is no longer reported (docs/design.md#security).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from factories import synthetic_candidates
from mlflow import MlflowClient

from dpmerge import policy_merge as pm
from dpmerge.cli import main


@pytest.fixture
def workspace(tmp_path: Path) -> pm.Workspace:
    """An embedded home whose registry holds three signed candidates."""
    home = tmp_path / "home"
    workspace = pm.Workspace(f"sqlite:///{home / 'mlflow.db'}", home, None)
    registry = workspace.registry()
    dirs = synthetic_candidates(tmp_path / "dirs", {"a": 1.0, "b": 2.0, "c": 4.0}, "digits")
    for path in dirs:
        registry.register_candidate(path)
    return workspace


def _verify(workspace: pm.Workspace, capsys: pytest.CaptureFixture[str]) -> tuple[int, list]:
    code = main(["registry", "verify", "--json", "--tracking-uri", workspace.tracking_uri])
    return code, json.loads(capsys.readouterr().out)["findings"]


def test_a_forged_candidate_is_reported_until_quarantined(
    workspace: pm.Workspace, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = ["--tracking-uri", workspace.tracking_uri]
    assert _verify(workspace, capsys) == (0, [])
    client = MlflowClient(workspace.tracking_uri, workspace.tracking_uri)
    (model,) = {v.name for v in client.search_model_versions()}
    client.set_model_version_tag(model, "1", "dp.noise_multiplier", "10.0")  # σ ×10, unsigned
    client.delete_model_version_tag(model, "3", "dp.signature")  # planted without the key
    code, findings = _verify(workspace, capsys)
    assert code == 1
    assert [(f["kind"], f["subject"]) for f in findings] == [
        ("candidate_forged", f"{model} v1"),
        ("candidate_forged", f"{model} v3"),
    ]
    assert "does not verify" in findings[0]["detail"] and "unsigned" in findings[1]["detail"]
    assert f"registry quarantine {model} 1" in findings[0]["detail"]
    assert main(["registry", "verify", *uri]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert f"candidate_forged: {model} v1: its signed record does not verify" in lines[1]
    assert lines[-1].startswith("2 finding(s)")
    for version in ("1", "3"):
        assert main(["registry", "quarantine", model, version, *uri]) == 0
    capsys.readouterr()
    client.set_model_version_tag(model, "1", "dp.status", "ready")  # an insider flips it back
    code, findings = _verify(workspace, capsys)  # the store's quarantine decides: v1 is out,
    assert [(f["kind"], f["subject"]) for f in findings] == [  # and MLflow's tag is drift
        ("quarantine_drift", f"{model} v1")
    ]
