"""The Prefect flows in-process (Prefect's test harness, embedded sqlite MLflow) on digits:
train-candidates → merge-on-policy (promote, reuse, refusals, the serving invariant's states),
verify-state, pareto-report, the CLI's in-process path (policy set/apply/ls/show/history, dry
runs, exit codes), the deployment file, and ``dpmerge demo`` end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from mlflow import MlflowClient

from devstack.provision import locked_template
from devstack.roles import LOCKED_POOLS_ENV
from dpmerge import policy_merge as pm
from dpmerge.policies import Policy, policy_from_dict
from dpmerge.state import policies as stored_policies

REPO = Path(__file__).resolve().parents[1]
PREFECT_YAML = REPO / "deployments" / "prefect.yaml"
DELTA = 1e-5


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Embedded MLflow and state directory for this module, and one Prefect test server."""
    from prefect.testing.utilities import prefect_test_harness

    home = tmp_path_factory.mktemp("home")
    uri = f"sqlite:///{home / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        patch.setenv("DPMERGE_HOME", str(home))
        patch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        for key in (
            "PREFECT_API_URL",
            "PREFECT_API_AUTH_STRING",
            "DPMERGE_S3_ENDPOINT_URL",
            "DPMERGE_S3_BUCKET",
            LOCKED_POOLS_ENV,  # no stack here: verify-state checks no stack's pools
        ):
            patch.delenv(key, raising=False)
        torch.set_num_threads(1)
        try:
            with prefect_test_harness(server_startup_timeout=120):
                yield {"home": home, "uri": uri}
        finally:
            from dpmerge.accounting import pld

            pld.set_disk_cache(None)  # the flows turned the file cache on for this process


@pytest.fixture(scope="module")
def training(env: dict[str, Any]) -> dict[str, Any]:
    from flows.training import train_candidates

    return train_candidates(
        dataset="digits",
        model="logreg",
        noise_multipliers=[1.0, 1.6, 3.0],
        epochs=3,
        batch_size=64,
        learning_rate=1.0,
    )


@pytest.fixture(scope="module")
def trained(training: dict[str, Any]) -> list[dict[str, Any]]:
    return training["candidates"]


def _policy(**fields: Any) -> Policy:
    base = {"name": "p", "target_epsilon": 5.0, "target_delta": DELTA, "dataset": "digits"}
    return policy_from_dict({"model": "logreg", **base, **fields})


def _registry(env: dict[str, Any]) -> Any:
    return pm.Workspace(env["uri"], env["home"]).registry()


def _versions(env: dict[str, Any]) -> list[tuple[str, str]]:
    return [(v.name, v.version) for v in _registry(env).list_versions()]


def _alias(env: dict[str, Any], model: str, alias: str) -> str | None:
    return _registry(env).aliases(model).get(alias)


def _eps(trained: list[dict[str, Any]]) -> list[float]:
    return sorted(c["epsilon"] for c in trained)


# --- deployments/prefect.yaml -------------------------------------------------------------


def _deployments() -> dict[str, dict[str, Any]]:
    document = yaml.safe_load(PREFECT_YAML.read_text())
    return {d["entrypoint"].split(":")[1]: d for d in document["deployments"]}


def test_prefect_yaml_pools_schedule_and_concurrency() -> None:
    document = yaml.safe_load(PREFECT_YAML.read_text())
    found = _deployments()
    names = {k: d["name"] for k, d in found.items()}
    assert names == {  # deployment names say what they run
        "merge_on_policy": "merge-on-policy",
        "verify_state": "verify-state",
        "train_candidate": "train-candidate-gpu",
        "train_candidates": "train-candidates",
        "pareto_report": "pareto-report-nightly",
    }
    # a policy version becomes a run through the dispatcher, not an event trigger
    assert "triggers" not in found["merge_on_policy"]
    assert found["verify_state"]["schedules"][0]["cron"] == "*/5 * * * *"
    assert found["merge_on_policy"]["work_pool"]["name"] == "cpu"
    assert found["train_candidate"]["work_pool"]["name"] == "gpu"
    assert found["train_candidates"]["parameters"]["deployment"] == (
        "train-candidate/train-candidate-gpu"
    )
    # serialised per policy inside the flow, not per deployment: policies run side by side
    assert "concurrency_limit" not in found["merge_on_policy"]
    # the pools' templates fix the command (cpu runs start from a warm process); no deployment
    # brings job variables, which those templates refuse
    assert not any("job_variables" in d["work_pool"] for d in found.values())
    # with the worker host's own interpreter: no path into this checkout (test_workers.py)
    assert locked_template("cpu")["job_configuration"]["command"] == "python -m flows.warm"
    assert locked_template("gpu")["job_configuration"]["command"] == "python -m prefect.engine"
    assert found["pareto_report"]["schedules"][0]["cron"] == "0 2 * * *"
    (pull,) = document["pull"]
    assert "set_working_directory" in next(iter(pull))
    gpu = document["definitions"]["kubernetes_gpu_job_template"]
    container = gpu["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" in container["containers"][0]["resources"]["limits"]
    # each entrypoint names the flow its deployment is for
    from flows.merge import merge_on_policy
    from flows.report import pareto_report
    from flows.training import train_candidate, train_candidates
    from flows.verify import verify_state

    flows = [merge_on_policy, verify_state, train_candidate, train_candidates, pareto_report]
    for flow in flows:
        name = flow.fn.__name__
        module = found[name]["entrypoint"].split(":")[0]
        assert (
            Path(REPO / module).is_file() and flow.fn.__module__.replace(".", "/") + ".py" == module
        )


def test_training_flows_take_the_declared_training_parameters() -> None:
    from prefect.exceptions import ParameterTypeError

    from dpmerge.training import RunOptions, TrainConfig, declared_parameters
    from flows.training import plan_candidates, train_candidate, train_candidates
    from tasks.training import CandidateSpec

    declared = [*declared_parameters(TrainConfig), *declared_parameters(RunOptions)]
    one = train_candidate.parameters
    assert set(one.properties) == {p.name for p in declared} | {"keep_last_epochs"}
    assert set(one.required) == {"name", "dataset", "model"}
    for parameter in declared:
        assert one.properties[parameter.name]["description"] == parameter.help
    assert one.properties["device"]["default"] == "auto"
    fan_out = train_candidates.parameters
    shared = {p.name for p in declared} - {"name", "noise_multiplier", "target_epsilon"}
    own = {"noise_multipliers", "target_epsilons", "deployment"}
    switches = {"deployment_timeout_s", "prime_merge_caches", "frontier_report", "keep_last_epochs"}
    switches |= {"imports"}
    assert set(fan_out.properties) == shared | own | switches
    assert fan_out.properties["dataset"]["default"] == "fashion-mnist" and not fan_out.required
    # a deployment run gets exactly the parameters the one-candidate flow validates
    (spec,) = plan_candidates("digits", "cnn", [1.5], None, epochs=2, limit=300, torch_threads=2)
    validated = train_candidate.validate_parameters(spec.parameters())
    assert CandidateSpec.from_parameters(validated) == spec
    with pytest.raises(ParameterTypeError, match="dataset"):
        train_candidate.validate_parameters({**spec.parameters(), "dataset": "imagenet"})


def test_merge_on_policy_takes_a_stored_version() -> None:
    from flows.merge import merge_on_policy

    assert set(merge_on_policy.parameters.properties) == {"policy", "version"}
    assert merge_on_policy.parameters.required == ["policy", "version"]


# --- flows in-process ---------------------------------------------------------------------


def test_remote_tasks_retry_transient_errors_only_and_give_up(env) -> None:
    """``REMOTE`` tasks (``retry_transient``): a transient error is retried, up to the bound;
    a refusal is not retried at all."""
    from prefect import flow, task

    from dpmerge.registry import GateError, RegistryUnavailableError
    from dpmerge.storage import StorageUnavailableError
    from tasks.common import REMOTE, RETRY_DELAYS

    failures: dict[str, list[Exception]] = {
        "recovers": [StorageUnavailableError("S3 throttled (SlowDown)")],
        "refused": [GateError("m", "1", ["accuracy 0.1 is below the minimum 0.8"])] * 9,
        "down": [RegistryUnavailableError("MLflow server unreachable")] * 9,
    }
    attempts: list[str] = []

    @task(**{**REMOTE, "retry_delay_seconds": 0})
    def step(kind: str) -> str:
        attempts.append(kind)
        if attempts.count(kind) <= len(failures[kind]):
            raise failures[kind][attempts.count(kind) - 1]
        return "done"

    @flow
    def run(kind: str) -> str:
        return step(kind)

    assert run("recovers") == "done" and attempts.count("recovers") == 2
    with pytest.raises(GateError, match="below the minimum"):
        run("refused")
    assert attempts.count("refused") == 1
    with pytest.raises(RegistryUnavailableError, match="unreachable"):
        run("down")
    assert attempts.count("down") == 1 + len(RETRY_DELAYS)


def test_train_candidates_reports_what_it_spent_and_the_frontier(env, training) -> None:
    """The flow names its registry, each candidate's σ and ε under PLD and RDP at δ (and, in
    its unpersisted result, the accuracies), and logs the frontier at once."""
    assert training["registry"] == {
        "uri": env["uri"],
        "kind": "embedded",
        "source": "$MLFLOW_TRACKING_URI",
    }
    for candidate in training["candidates"]:
        assert candidate["delta"] == DELTA and candidate["dataset_size"] > 1000
        assert 0 < candidate["epsilon_pld"] <= candidate["epsilon_rdp"]
        assert candidate["epsilon"] == candidate["epsilon_pld"]  # the smaller one gates
        assert 0 < candidate["validation_accuracy"] <= 1
    frontier = training["frontier"]
    assert frontier["artifacts"] == ["frontier.png", "frontier.csv", "frontier.md"]
    client = MlflowClient(env["uri"], env["uri"])
    run = client.get_run(frontier["run_id"])
    assert client.get_experiment(run.info.experiment_id).name == "dpmerge-reports"
    assert "frontier.png" in {f.path for f in client.list_artifacts(frontier["run_id"])}
    assert frontier["registered_model"] == training["candidates"][0]["registered_model"]


def test_train_candidates_registers_each_level(env, trained) -> None:
    assert len(trained) == 3
    assert sorted(c["noise_multiplier"] for c in trained) == [1.0, 1.6, 3.0]
    assert len({c["version"] for c in trained}) == 3
    names = {c["registered_model"] for c in trained}
    assert names == {pm.find_candidates(_registry(env), "digits", "logreg").registered_model}
    by_noise = sorted(trained, key=lambda c: c["noise_multiplier"])
    eps = [c["epsilon"] for c in by_noise]
    assert eps[0] > eps[1] > eps[2] > 0  # more noise, a smaller certified ε
    from dpmerge.training import TrainingConfigError
    from flows.training import plan_candidates

    with pytest.raises(TrainingConfigError, match="exactly one"):
        plan_candidates("digits", "logreg", [1.0], [2.0])
    specs = plan_candidates("digits", "logreg", None, [1.0, 2.0], epochs=2)
    assert [s.config.target_epsilon for s in specs] == [1.0, 2.0] and specs[0].config.epochs == 2


def test_train_candidates_imports_and_registers_a_model_trained_elsewhere(env, tmp_path) -> None:
    """An ``imports`` entry becomes a registered candidate whose verified record names its
    attester (docs/design.md#imported-candidates); a malformed entry fails before training."""
    from dpmerge.data import load_dataset
    from dpmerge.errors import InputError
    from dpmerge.models import build_model, model_spec
    from flows.training import train_candidates

    spec = model_spec("logreg", load_dataset("digits"))
    torch.save(build_model(spec, seed=3).state_dict(), tmp_path / "w.pt")
    profile = {
        "profile": "record", "noise_multiplier": 2.0, "sample_rate": 0.05, "steps": 60,
        "clip_norm": 1.0, "learning_rate": 0.5, "expected_batch_size": 64.0,
        "optimizer": "sgd", "sampling": "poisson", "neighbouring": "add_or_remove_one",
    }  # fmt: skip
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    entry = {
        "name": "elsewhere", "weights": str(tmp_path / "w.pt"),
        "profile": str(tmp_path / "profile.json"), "attested_by": "Acme DP team",
    }  # fmt: skip
    kwargs = {"dataset": "digits", "model": "logreg", "noise_multipliers": [2.5], "epochs": 1}
    kwargs |= {"prime_merge_caches": False, "frontier_report": False}
    with pytest.raises(InputError, match="imports entry 'attested_by'"):
        train_candidates(**kwargs, imports=[{**entry, "attested_by": ""}])
    result = train_candidates(**kwargs, imports=[entry])
    imported = next(c for c in result["candidates"] if c["name"] == "elsewhere")
    assert imported["noise_multiplier"] == 2.0
    loaded = _registry(env).load_candidates(
        imported["registered_model"], [imported["version"]], dest=tmp_path / "dl"
    )
    assert loaded[0].published.attested_by == "Acme DP team"


def _store(env: dict[str, Any], policy: Policy) -> stored_policies.PolicyVersion:
    workspace = pm.Workspace(env["uri"], env["home"])
    fields = policy.event_payload()
    change = stored_policies.set_policy(
        workspace.state(), policy.name, fields, source="t", rerun=True
    )
    return change.version


def _apply(env: dict[str, Any], policy: Policy) -> Any:
    """Store ``policy`` as a new version and run merge-on-policy for it in-process."""
    from flows.merge import merge_on_policy

    version = _store(env, policy)
    return merge_on_policy(version.name, version.version, return_state=True)


def test_merge_on_policy_promotes_then_reuses(env, trained) -> None:
    policy = _policy(name="flow-lc", target_epsilon=_eps(trained)[1] * 1.2, method="lc")
    state = _apply(env, policy)
    result = state.result()
    assert state.is_completed() and state.name == "Completed"
    assert result["status"] == "promoted" and result["method"] == "lc"
    assert result["epsilon"] <= policy.target_epsilon and not result["reused"]
    assert _alias(env, result["merged_model"], "policy-flow-lc") == result["version"]
    card = _registry(env).card_text(result["merged_model"], result["version"])
    assert card.startswith("# Privacy card")
    # one way to print ε: rounded up, on the card and in the run's line (beside ε*, with the
    # decimals that keep ε ≤ ε* visible)
    from dpmerge.formatting import epsilon_text, within_text

    assert f"ε = **{epsilon_text(result['epsilon'])}**" in card
    assert within_text(result["epsilon"], policy.target_epsilon) in state.message
    again = _apply(env, policy)
    assert again.is_completed() and again.name == "Unchanged"
    assert again.result()["status"] == "unchanged" and again.result()["reused"]
    assert again.result()["version"] == result["version"]
    assert again.message.startswith("policy flow-lc v2: unchanged — ")
    # each run's outcome is kept with its policy version in the release-state store
    store = pm.Workspace(env["uri"], env["home"]).state()
    (recorded,) = stored_policies.outcomes(store, "flow-lc", 2)
    assert recorded["status"] == "unchanged" and recorded["state"] == "Unchanged"


def test_rs_flow_keeps_the_draw_out_of_its_result(env, trained) -> None:
    policy = _policy(name="flow-rs", target_epsilon=_eps(trained)[1] * 1.05, method="rs")
    result = _apply(env, policy).result()
    assert result["status"] == "promoted" and result["method"] == "rs"
    text = json.dumps(result)
    assert "drawn" not in text and "audit" not in text
    records = [json.loads(p.read_text()) for p in (env["home"] / "audit").glob("*.json")]
    assert any(r.get("notes", {}).get("policy") == "flow-rs" for r in records)


MALFORMED = {
    "missing name": ({"name": None}, "name"),
    "missing target": ({"target_epsilon": ...}, "missing field 'target_epsilon'"),
    "string for a number": ({"target_epsilon": "2.0"}, "target_epsilon"),
    "boolean for a number": ({"min_accuracy": True}, "min_accuracy"),
    "null for a number": ({"target_delta": None}, "target_delta"),
    "extra field": ({"gpu": "yes"}, "unknown field 'gpu'"),
    "unknown method": ({"method": "avg"}, "method"),
    "negative target": ({"target_epsilon": -1.0}, "target_epsilon"),
    "huge name": ({"name": "x" * 100_000}, "larger than 65,536 bytes"),  # refused unparsed
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_stored_version_is_a_rejected_run_that_changes_nothing(
    env, trained, case
) -> None:
    """A version written into the store by hand that is not a valid policy ends as a run
    ``Rejected`` (Failed type, no traceback) with one line naming the field; nothing is read
    or written, and it supersedes nothing."""
    from flows.merge import merge_on_policy

    change, expected = MALFORMED[case]
    policy = _policy(name="bad").event_payload() | change
    policy = {k: v for k, v in policy.items() if v is not ...}
    store = pm.Workspace(env["uri"], env["home"]).state()
    number = stored_policies.newest_number(store, "bad") + 1
    document = {"schema": stored_policies.SCHEMA, "name": "bad", "version": number}
    document |= {"created": "", "author": "hand", "source": "hand", "changes": {}}
    store.create(stored_policies.version_key("bad", number), {**document, "policy": policy})
    before = _versions(env)
    state = merge_on_policy("bad", number, return_state=True)
    assert state.is_failed() and state.name == "Rejected"
    assert expected in state.message and len(state.message) < 400
    assert "\n" not in state.message and "Traceback" not in state.message
    assert state.result(raise_on_failure=False)["status"] == "rejected"
    assert _versions(env) == before


def test_a_version_that_does_not_exist_or_does_not_fit_is_rejected(env, trained) -> None:
    from flows.merge import merge_on_policy

    state = merge_on_policy("nobody", 3, return_state=True)
    assert state.name == "Rejected" and "has no stored version 3" in state.message
    for field, value in (("dataset", "digitz"), ("model", "resnet")):
        version = _store(env, _policy(name="misfit", **{field: value}))
        state = merge_on_policy("misfit", version.version, return_state=True)
        assert state.name == "Rejected" and f"field '{field}'" in state.message


def test_the_serving_invariant_names_the_run_states(env, trained) -> None:
    """Expected outcomes are not crashes: one line each, the same document as the artifact.
    Completed when the alias serves a release that meets the policy's version; Failed —
    named ``Revoked`` or ``Noncompliant`` — when it does not (docs/workflow.md#outcomes)."""
    first = _apply(env, _policy(name="flow-gate", target_epsilon=_eps(trained)[2] * 1.5)).result()
    assert first["status"] == "promoted"
    before = _versions(env)
    below = _policy(name="flow-gate", target_epsilon=_eps(trained)[0] / 2)
    infeasible = _apply(env, below)
    assert infeasible.is_failed() and infeasible.name == "Revoked"
    assert "below the most private" in infeasible.message
    assert infeasible.result(raise_on_failure=False)["revoked_version"] == first["version"]
    assert _alias(env, first["merged_model"], "policy-flow-gate") is None
    assert _versions(env) == before  # nothing registered
    again = _apply(env, below)  # serves nothing already: Failed, named for the outcome
    assert again.is_failed() and again.name == "Infeasible"
    back = _apply(env, _policy(name="flow-gate", target_epsilon=_eps(trained)[2] * 1.5))
    assert back.name == "Completed"
    strict = _policy(name="flow-gate", target_epsilon=_eps(trained)[2] * 1.5, min_accuracy=0.999)
    kept = _apply(env, strict.model_copy(update={"on_noncompliant": "keep"}))
    assert kept.is_failed() and kept.name == "Noncompliant"
    assert "KEEPS" in kept.message and "below" in kept.message
    _apply(env, _policy(name="flow-gate", target_epsilon=_eps(trained)[2] * 1.5))
    capped = _policy(
        name="flow-gate", target_epsilon=_eps(trained)[2] * 1.5, cumulative_epsilon_cap=0.01
    )
    gate = _apply(env, capped)  # refused, and the alias keeps a release that meets it
    assert gate.is_completed() and gate.name == "NotPromoted"
    assert gate.result()["status"] == "not_promoted" and "above the cap" in gate.message


def test_pareto_report_logs_the_frontier_to_mlflow(env, trained) -> None:
    from flows.report import default_targets, pareto_report

    eps = _eps(trained)
    result = pareto_report(dataset="digits", model="logreg", targets=[eps[1] * 1.1])
    assert result["artifacts"] == ["frontier.png", "frontier.csv", "frontier.md"]
    client = MlflowClient(env["uri"], env["uri"])
    stored = {f.path for f in client.list_artifacts(result["run_id"])}
    assert stored == {"frontier.png", "frontier.csv", "frontier.md"}
    csv = client.download_artifacts(result["run_id"], "frontier.csv", str(env["home"]))
    kinds = Path(csv).read_text()
    assert "candidate" in kinds and "rs" in kinds and "lc-generic" in kinds
    grid = default_targets([0.5, 2.0])
    assert grid[0] > 0.5 and grid[-1] == pytest.approx(4.0, rel=1e-2)
    assert grid == sorted(grid)


# --- the CLI without a server: in-process ---------------------------------------------------


def _flow_runs() -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return len(client.read_flow_runs(limit=200))


def _json_lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_cli_policy_set_and_apply_run_in_process(
    env, trained, tmp_path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.cli import main

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))  # leave the process as it was
    target = f"{_eps(trained)[2] * 1.3:.4f}"
    assert main(["policy", "set", "--name", "cli", "--target-epsilon", target]) == 2
    assert "is new: give --target-epsilon and --delta" in capsys.readouterr().err
    code = main(
        [
            *("policy", "set", "--name", "cli", "--target-epsilon", target, "--delta", "1e-5"),
            *("--dataset", "digits", "--min-accuracy", "0.5", "--json"),
        ]
    )
    outcome = _json_lines(capsys.readouterr().out)[-1]
    assert code == 0 and outcome["status"] == "promoted" and outcome["policy"] == "cli"
    assert outcome["registry"]["kind"] == "embedded" and outcome["registry"]["uri"] == env["uri"]
    # a partial change keeps every field it does not name
    assert main(["policy", "set", "--name", "cli", "--target-epsilon", "9", "--json"]) == 0
    capsys.readouterr()
    assert main(["policy", "show", "cli", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["version"] == 2 and shown["policy"]["min_accuracy"] == 0.5
    assert shown["policy"]["target_epsilon"] == 9.0 and shown["serving"]["state"] == "serving"
    assert main(["policy", "history", "cli"]) == 0
    history = capsys.readouterr().out
    assert "v1 " in history and "v2 " in history and "target_epsilon: " in history
    assert "outcome: promoted" in history
    assert main(["policy", "set", "--name", "cli", "--target-epsilon", "9"]) == 0
    assert "no change (v2 is current)" in capsys.readouterr().out
    assert main(["policy", "ls"]) == 0
    assert "cli" in capsys.readouterr().out

    before = _versions(env)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "policies": [
                    {"name": "file-ok", "target_epsilon": 4.0, "target_delta": DELTA}
                    | {"dataset": "digits", "model": "logreg"},
                    {"name": "file-bad", "target_epsilon": -2.0, "target_delta": DELTA}
                    | {"dataset": "digits", "model": "logreg"},
                ]
            }
        )
    )
    assert main(["policy", "apply", "-f", str(bad)]) == 2
    assert "file-bad" in capsys.readouterr().err
    assert _versions(env) == before  # the whole file was rejected: nothing applied
    store = pm.Workspace(env["uri"], env["home"]).state()
    assert stored_policies.latest(store, "file-ok") is None

    good = tmp_path / "good.yaml"
    good.write_text(bad.read_text().replace("-2.0", "3.0"))
    assert main(["policy", "apply", "-f", str(good), "--json"]) == 0
    statuses = [d["status"] for d in _json_lines(capsys.readouterr().out)]
    assert statuses == ["promoted", "promoted"]
    # declarative: the same file again changes nothing; one changed policy runs alone
    assert main(["policy", "apply", "-f", str(good), "--json"]) == 0
    assert [d["status"] for d in _json_lines(capsys.readouterr().out)] == ["unchanged"] * 2
    changed = tmp_path / "changed.yaml"
    changed.write_text(good.read_text().replace("4.0", "5.0"))
    assert main(["policy", "apply", "-f", str(changed), "--dry-run"]) == 0
    preview = capsys.readouterr().out
    assert "policy file-ok v1: target_epsilon: 4.0 → 5.0" in preview
    assert "policy file-bad (dry run): no change to v1" in preview
    assert stored_policies.latest(store, "file-ok").version == 1  # the dry run stored nothing


def test_policy_set_fails_fast_on_a_typo_and_starts_no_run(env, trained, capsys) -> None:
    """A typo'd dataset or model is refused before any flow starts: one line naming the field
    and listing the registered choices, exit 2, within seconds."""
    import time

    from flows.cli import main

    runs = _flow_runs()
    for flag, value, field in (("--dataset", "digitz", "dataset"), ("--model", "cnn", "model")):
        start = time.perf_counter()
        args = ["policy", "set", "--name", "typo", "--target-epsilon", "2", "--delta", "1e-5"]
        dataset = () if flag == "--dataset" else ("--dataset", "digits")  # an option once
        code = main([*args, *dataset, flag, value])
        seconds = time.perf_counter() - start
        err = capsys.readouterr().err
        assert code == 2 and seconds < 10, (code, seconds)
        assert err.count("\n") == 1 and f"field '{field}'" in err and "choose one of" in err
    assert "'digits'" in err or "'logreg'" in err
    with pytest.raises(SystemExit) as bad_choice:  # choices come from the Policy model
        main([*args, "--method", "avg"])
    assert bad_choice.value.code == 2 and "invalid choice: 'avg'" in capsys.readouterr().err
    assert _flow_runs() == runs  # no flow run started
    store = pm.Workspace(env["uri"], env["home"]).state()
    assert stored_policies.latest(store, "typo") is None  # nothing stored


def _state_files(env: dict[str, Any]) -> dict[str, bytes]:
    home = env["home"]
    files = {}
    for folder in ("state", "audit"):
        for path in sorted((home / folder).rglob("*")):
            if path.is_file() and not path.name.endswith(".lock"):
                files[str(path.relative_to(home))] = path.read_bytes()
    return files


def test_dry_run_reports_the_release_and_changes_nothing(env, trained, capsys) -> None:
    from dpmerge.registry.catalog import open_catalog
    from flows.cli import main

    catalog = open_catalog(env["uri"])
    merged = pm.find_candidates(_registry(env), "digits", "logreg").merged_model

    def snapshot() -> tuple[Any, ...]:
        rows = catalog.rows()
        cards = [catalog.description(r.name, r.version) for r in rows]
        return rows, cards, catalog.aliases(merged), _state_files(env), _flow_runs()

    before = snapshot()
    base = ["policy", "set", "--name", "what-if", "--delta", "1e-5", "--dataset", "digits"]
    target = f"{_eps(trained)[1] * 1.2:.4f}"  # between two rungs of the ladder
    code = main([*base, "--target-epsilon", target, "--method", "auto", "--dry-run", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["dry_run"] and report["verdict"] == "would_promote"
    # auto releases a secret draw between two LC merges: both rungs and their odds shown
    assert report["epsilon"] <= float(target) and report["method"] == "mixture", report
    assert report["weights"] is None and len(report["rungs"]) == 2
    assert math.isclose(sum(r["probability"] for r in report["rungs"]), 1.0)
    assert all(0 < r["probability"] < 1 and r["members"] for r in report["rungs"])
    # only what the records give: the noise proxy's expected utility, never an accuracy
    # (docs/design.md#operator-trust)
    assert report["expected_utility"] == report["compared"]["mixture"]["expected_utility"] < 0
    assert not [k for k in report if "accuracy" in k]
    assert "accuracy" not in json.dumps(report["compared"])
    assert {g["name"] for g in report["gates"]} == {"epsilon", "delta", "accuracy", "ledger"}
    accuracy = next(g for g in report["gates"] if g["name"] == "accuracy")
    assert (
        accuracy["passes"] is None and "evaluates no validation or test rows" in accuracy["detail"]
    )
    assert report["registry"]["uri"] == env["uri"] and report["registry"]["kind"] == "embedded"
    code = main([*base, "--target-epsilon", target, "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0 and "policy what-if: new" in out
    assert "policy what-if (dry run): would promote — MIXTURE of merge 1 with probability" in out
    # an infeasible what-if revokes nothing and exits as the real one would
    code = main([*base, "--target-epsilon", f"{_eps(trained)[0] / 2:.4f}", "--dry-run"])
    assert code == 3 and "infeasible" in capsys.readouterr().out
    code = main([*base, "--target-epsilon", "9", "--min-accuracy", "0.999", "--dry-run"])
    out = capsys.readouterr().out  # the minimum is checked on the release, when applied
    assert code == 0 and "the accuracy minimum 0.999 is checked on the released model" in out
    assert "expected noise-proxy utility -" in out and "test accuracy" not in out
    # δ ≥ 1/n (digits: about 1,300 training rows) would permit releasing rows: refused, n named
    for delta in ("0.5", "1e-3"):
        what_if = ["policy", "set", "--name", "what-if", "--delta", delta, "--dataset", "digits"]
        assert main([*what_if, "--target-epsilon", "5", "--dry-run"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "Traceback" not in err
        assert f"δ = {float(delta):g} is not below 1/n" in err and "training rows" in err
    assert snapshot() == before  # versions, cards, aliases, ledger, audit, runs


def test_cli_exit_codes_match_the_outcome(env, trained, capsys) -> None:
    from flows.cli import main

    base = ["policy", "set", "--name", "codes", "--delta", "1e-5", "--dataset", "digits"]
    assert main([*base, "--target-epsilon", f"{_eps(trained)[2] * 1.5:.4f}"]) == 0
    assert capsys.readouterr().out.startswith("policy codes v1: promoted — ")
    assert main([*base, "--target-epsilon", f"{_eps(trained)[0] / 2:.4f}"]) == 3
    out, err = capsys.readouterr()
    assert out.startswith("policy codes v2: infeasible — ") and "revoked" in out
    assert "Traceback" not in out + err
    strict = [*base, "--target-epsilon", f"{_eps(trained)[2] * 1.4:.4f}", "--min-accuracy", "0.999"]
    assert main(strict) == 4
    assert capsys.readouterr().out.startswith("policy codes v3: not promoted — ")


def test_a_rerun_over_swapped_weights_is_refused_revoked_and_exit_2(env, trained, capsys) -> None:
    """Issue 28 row I through the CLI: weights swapped under the served release in the
    artifact store; `policy set --rerun` does not say "unchanged": the run is Failed
    ``Refused`` (exit 2), the alias is revoked, and the history records it."""
    from urllib.parse import urlparse

    from flows.cli import main

    base = ["policy", "set", "--name", "swap", "--delta", "1e-5", "--dataset", "digits"]
    assert main([*base, "--target-epsilon", f"{_eps(trained)[2] * 1.5:.4f}", "--json"]) == 0
    served = _json_lines(capsys.readouterr().out)[-1]
    model, version = served["merged_model"], served["version"]
    assert main(["policy", "set", "--name", "swap", "--rerun"]) == 0
    assert "unchanged" in capsys.readouterr().out
    client = MlflowClient(env["uri"], env["uri"])
    stored = Path(urlparse(client.get_model_version(model, version).source).path)
    weights = stored / "extra_files" / "weights.safetensors"
    original = weights.read_bytes()  # other policies of this module share the release
    weights.write_bytes(original[:-8] + bytes(8))
    try:
        code = main(["policy", "set", "--name", "swap", "--rerun", "--json"])
        outcome = _json_lines(capsys.readouterr().out)[-1]
        state = _apply(env, _policy(name="swap", target_epsilon=served["target_epsilon"]))
    finally:
        weights.write_bytes(original)
    assert code == 2 and outcome["status"] == "refused", outcome
    assert outcome["revoked_version"] == version and outcome["serving"] == "revoked"
    assert state.is_failed() and state.name == "Refused"  # already revoked: still refused
    assert "serves nothing (revoked)" in state.message
    assert "weights.safetensors" in outcome["reasons"][0]
    assert _alias(env, model, "policy-swap") is None
    assert main(["policy", "history", "swap"]) == 0
    assert "outcome: refused" in capsys.readouterr().out


def test_another_policys_alias_is_a_rejected_run_and_exit_2(env, trained, capsys) -> None:
    """Naming an alias another policy owns is bad input: a ``Rejected`` run (exit 2, one line),
    never a crash, and the owner's alias stays."""
    from flows.cli import main

    owner = _apply(env, _policy(name="owner", target_epsilon=_eps(trained)[2] * 1.5))
    model, version = owner.result()["merged_model"], owner.result()["version"]
    hijack = _policy(name="thief", alias="policy-owner", target_epsilon=_eps(trained)[0] / 2)
    before = _versions(env)
    state = _apply(env, hijack)
    assert state.is_failed() and state.name == "Rejected"
    assert "belongs to policy 'owner'" in state.message and "\n" not in state.message
    args = ["policy", "set", "--name", "thief", "--alias", "policy-owner", "--delta", "1e-5"]
    assert main([*args, "--dataset", "digits", "--target-epsilon", "50"]) == 2
    out, err = capsys.readouterr()
    assert "belongs to policy 'owner'" in out + err and "Traceback" not in out + err
    assert _versions(env) == before and _alias(env, model, "policy-owner") == version


def test_a_stored_delta_at_least_1_over_n_is_a_rejected_run_with_its_outcome(env, trained) -> None:
    """Issue 28 row K, the run's side: a version stored with δ* ≥ 1/n (written around `policy
    set`, which refuses it) ends `Rejected` with its outcome recorded, never a plain `Failed`
    with a traceback, and changes nothing."""
    before = _versions(env)
    state = _apply(env, _policy(name="wide-delta", target_delta=0.5))
    assert state.is_failed() and state.name == "Rejected", state.message
    assert "1/n" in state.message and "\n" not in state.message
    (outcome,) = stored_policies.outcomes(
        pm.Workspace(env["uri"], env["home"]).state(), "wide-delta", 1
    )
    assert (outcome["status"], outcome["state"]) == ("rejected", "Rejected")
    assert _versions(env) == before


def test_verify_state_reports_drift_as_a_failed_run(env, trained) -> None:
    from flows.verify import verify_state

    owner = _apply(env, _policy(name="drift", target_epsilon=_eps(trained)[2] * 1.5)).result()
    clean = verify_state(return_state=True)
    assert clean.is_completed(), clean.message
    client = MlflowClient(env["uri"], env["uri"])
    client.set_registered_model_alias(owner["merged_model"], "by-hand", owner["version"])
    drift = verify_state(return_state=True)
    assert drift.is_failed() and drift.name == "Drift" and "unmanaged_alias" in drift.message
    assert "by-hand" not in _registry(env).aliases(owner["merged_model"])  # repaired
    assert verify_state(return_state=True).is_completed()


def test_training_keeps_a_runs_last_epochs_as_checkpoints_of_one_run(env, tmp_path) -> None:
    """``keep_last_epochs``: each run registers its weights at the end of its last epochs, one
    run id per run, so a merge counts a run once (at its longest checkpoint); an ``auto``
    policy at the least noisy run's ε releases within it."""
    from dpmerge.accounting.generic import release_units
    from dpmerge.training import TrainingConfigError
    from flows.training import train_candidates

    result = train_candidates(
        dataset="digits",
        model="cnn",
        noise_multipliers=[1.0, 2.5],
        epochs=3,
        keep_last_epochs=2,
        batch_size=64,
        prime_merge_caches=False,
        frontier_report=False,
    )
    names = sorted(c["name"][-3:] for c in result["candidates"])
    assert names == ["-e2", "-e2", "-e3", "-e3"]
    registry = _registry(env)
    pool = pm.find_candidates(registry, "digits", "cnn")
    loaded = pm.load_candidates(registry, pool, tmp_path)
    runs: dict[float, list[Any]] = {}
    for candidate in loaded:
        record = candidate.model_dir.record
        runs.setdefault(record.noise_multiplier, []).append(record)
    assert sorted(runs) == [1.0, 2.5]
    for records in runs.values():
        assert len({r.run_id for r in records}) == 1
        assert sorted(r.steps for r in records) == [2 * 21, 3 * 21]  # ⌈1294 / 64⌉ an epoch
    assert len(release_units([c.published for c in loaded])) == 2  # four candidates, two runs
    target = max(c["epsilon"] for c in result["candidates"])
    with pytest.raises(TrainingConfigError, match=r"keep_last_epochs must be .* in 1\.\.2"):
        train_candidates(
            dataset="digits",
            model="cnn",
            noise_multipliers=[1.0],
            epochs=2,
            keep_last_epochs=3,
            prime_merge_caches=False,
            frontier_report=False,
        )
    assert len(pm.find_candidates(registry, "digits", "cnn").versions) == 4  # nothing trained
    state = _apply(env, _policy(name="kept", model="cnn", target_epsilon=target))
    outcome = state.result()
    assert outcome["status"] == "promoted" and outcome["epsilon"] <= target


# --- dpmerge demo ----------------------------------------------------------------------------


def test_demo_trains_registers_applies_and_promotes(tmp_path: Path) -> None:
    """The README's main job, as a fresh process (its own temporary Prefect API)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "MLFLOW_TRACKING", "DPMERGE_"))
    }
    env |= {"MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    command = [sys.executable, "-m", "flows.cli", "demo", "--dataset", "digits", "--epochs", "6"]
    done = subprocess.run(
        command,
        cwd=tmp_path,
        env=env | {"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "training 5 DP-SGD candidates" in out
    assert "policy eu v1: promoted" in out and "alias 'policy-eu' → v1" in out
    assert "# Privacy card" in out and "test accuracy" in out
    assert "bin/mlflow ui --backend-store-uri sqlite:///" in out and "prefect server start" in out
    assert "PREFECT_SERVER_API_PORT" in out and "bin/dpmerge registry ls" in out
    assert "[4/4] the privacy–utility frontier" in out and "logged to MLflow run" in out
    home = tmp_path / ".dpmerge"
    assert f"registry: sqlite:///{home}/mlflow.db (embedded; from the embedded state" in out
    assert (home / "mlflow.db").is_file() and (home / "mlartifacts").is_dir()
    assert (home / "prefect" / "prefect.db").is_file()  # the runs, for `prefect server start`
    assert list((home / "state" / "datasets").glob("*.json"))  # the ledger and the pointers
    assert (home / "state" / "policies" / "eu" / "00000001.json").is_file()
    # no key was given: the workflow generated its own, private, in the state directory
    assert (home / "secret.key").stat().st_mode & 0o777 == 0o600


def test_the_warm_server_preloads_without_starting_a_thread() -> None:
    """The warm flow-run server forks a child per run, which is safe only while it has started
    no thread: importing everything it preloads (Prefect's engine, the flows, torch.export's
    tracing machinery) must leave the main thread alone."""
    code = (
        "import threading, flows.warm as w\n"
        "for m in w.PRELOAD: __import__(m)\n"
        "from dpmerge.registry import prepare_process; prepare_process()\n"
        "from dpmerge import storage; storage.prepare_process()\n"
        "print(sorted(t.name for t in threading.enumerate()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "['MainThread']"


def test_the_warm_server_answers_under_a_socket_path_too_long_for_af_unix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deep ``$DPMERGE_HOME`` (a worker host's home under a long path) makes the socket's
    path longer than an AF_UNIX address may be: the server still binds it, in its own 0700
    directory, and a client still connects (else every run would start cold)."""
    from flows import warm

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    monkeypatch.setenv("DPMERGE_HOME", str(deep))
    path = warm.socket_path()
    assert len(str(path)) > 107
    path.parent.mkdir(parents=True, mode=0o700)
    assert warm._connect(path) is None  # nothing listens yet
    listener = warm._bind(path)
    assert listener is not None
    try:
        assert path.is_socket() and path.stat().st_mode & 0o777 == 0o600
        client = warm._connect(path)
        assert client is not None
        client.close()
        assert warm._bind(path) is None  # a second server sees the first one answer
    finally:
        listener.close()


def test_a_run_child_that_outlives_its_sigterm_is_killed_and_its_run_reported() -> None:
    """A run's client went away: its child gets SIGTERM; a child that does not stop (Prefect's
    handler raised inside an interpreter callback only prints the exception) is killed after
    the grace period, and a child ended by a signal has its run reported ``Crashed``
    (here the report is recorded instead of sent)."""
    code = (
        "import os, signal, socket, time, flows.warm as w\n"
        "calls = []\n"
        "w._report_crash = lambda env, signum, listener: calls.append((env, signum))\n"
        "w.TERM_GRACE_S = 0.5\n"
        "ready, told = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "    os.write(told, b'.')\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "os.read(ready, 1)\n"
        "ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "children = {pid: w._Child(ours, {'PREFECT__FLOW_RUN_ID': 'r'})}\n"
        "started = time.monotonic()\n"
        "w._hung_up(ours, children, [])\n"
        "while children and time.monotonic() - started < 30:\n"
        "    w._reap(children, theirs)\n"
        "    w._kill_stragglers(children)\n"
        "    time.sleep(0.05)\n"
        "print(calls, len(children), round(time.monotonic() - started, 1))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    calls, left, seconds = done.stdout.strip().rsplit(" ", 2)
    assert calls == "[({'PREFECT__FLOW_RUN_ID': 'r'}, 9)]" and left == "0", done.stdout
    assert 0.5 <= float(seconds) < 30
