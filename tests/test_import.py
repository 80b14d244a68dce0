"""Importing DP models trained elsewhere (docs/design.md#imported-candidates): each weights
format, each profile kind, bad inputs, the attestation, and the ε of LC and RS merges over
imported profiles re-derived with dp_accounting alone."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant
from factories import make_record
from safetensors import safe_open
from safetensors.torch import save_file
from scipy import optimize

from dpmerge.accounting.account import account
from dpmerge.accounting.ledger import cumulative_bound, release_for
from dpmerge.accounting.records import MechanismRecord, PrivacyLabel
from dpmerge.accounting.weights import initialisation_conflict
from dpmerge.cli import main
from dpmerge.data import load_dataset
from dpmerge.errors import RecordError, RefusalError
from dpmerge.importing import (
    ATTESTATION,
    WEIGHTS_DIGEST,
    attestation_message,
    import_candidate,
    weights_digest,
)
from dpmerge.keys import WorkflowKey
from dpmerge.merging import read_candidate_dir
from dpmerge.models import build_model, model_spec
from dpmerge.privacy_card import assumption_lines
from dpmerge.vocabulary import KeyPurpose, ProfileKind, WeightsFormat

DELTA = 1e-5
SIGMA, EPOCHS, BATCH = 1.2, 2, 64
RECORD_PROFILE = {
    "profile": "record",
    "noise_multiplier": 1.5,
    "sample_rate": 0.05,
    "steps": 200,
    "clip_norm": 1.0,
    "learning_rate": 0.5,
    "expected_batch_size": 64.0,
    "optimizer": "sgd",
    "sampling": "poisson",
    "neighbouring": "add_or_remove_one",
}
OPACUS_PROFILE = {
    "profile": "opacus",
    "clip_norm": 1.0,
    "learning_rate": 0.5,
    "expected_batch_size": float(BATCH),
    "optimizer": "sgd",
    "sampling": "poisson",
    "neighbouring": "add_or_remove_one",
}
RDP_PROFILE = {
    "profile": "rdp",
    "orders": [2.0, 4.0, 8.0, 16.0, 32.0],
    "epsilons": [0.1, 0.2, 0.4, 0.8, 1.6],
}
EPS_DELTA_PROFILE = {
    "profile": "epsilon_delta",
    "epsilons": [1.5, 1.0, 0.8],
    "deltas": [1e-7, 1e-6, 1e-5],
}


@pytest.fixture(scope="module")
def data():
    return load_dataset("digits")


@pytest.fixture(scope="module")
def spec(data):
    return model_spec("logreg", data)


@pytest.fixture(scope="module")
def opacus_checkpoint(tmp_path_factory, data, spec) -> tuple[Path, int, float]:
    """A logistic regression trained on digits with plain Opacus and saved by
    ``PrivacyEngine.save_checkpoint``: (path, steps, sample rate)."""
    from opacus import PrivacyEngine

    torch.manual_seed(0)
    model = build_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    dataset = torch.utils.data.TensorDataset(data.train.features, data.train.labels)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH)
    engine = PrivacyEngine(accountant="prv")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=SIGMA,
        max_grad_norm=1.0,
    )  # fmt: skip
    steps = 0
    for _ in range(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            steps += 1
    path = tmp_path_factory.mktemp("opacus") / "checkpoint.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    return path, steps, 1 / len(loader)


def _profile(tmp_path: Path, document: dict, name: str = "profile.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(document))
    return path


def _state_dict(spec, seed: int = 1) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in build_model(spec, seed=seed).state_dict().items()}


def _import(tmp_path, weights, profile, data, spec, name="imp", key=None):
    return import_candidate(
        weights, _profile(tmp_path, profile, f"{name}.json"), spec=spec, data=data, name=name,
        attested_by="Acme DP team", key=key or WorkflowKey.from_env(), out_dir=tmp_path / name,
        delta=DELTA,
    )  # fmt: skip


def test_an_opacus_checkpoint_imports_with_its_accountant_history(
    tmp_path, data, spec, opacus_checkpoint
) -> None:
    path, steps, rate = opacus_checkpoint
    key = WorkflowKey.generate()
    result = _import(tmp_path, path, OPACUS_PROFILE, data, spec, key=key)
    record = result.record
    assert result.weights_format == WeightsFormat.OPACUS and result.profile == ProfileKind.OPACUS
    assert isinstance(record, MechanismRecord)
    assert (record.noise_multiplier, record.sample_rate, record.steps) == (SIGMA, rate, steps)
    assert record.dataset == data.fingerprint and record.dataset_size == data.dataset_size
    assert record.attested_by == "Acme DP team"
    assert record.batch_lineage == f"unknown:{data.fingerprint}"
    loaded = read_candidate_dir(result.path)  # a candidate directory like a trained one
    assert loaded.record == record
    with safe_open(str(loaded.weights_file), "pt") as handle:
        meta = handle.metadata()
    digest = weights_digest(loaded.weights)
    assert meta[WEIGHTS_DIGEST] == digest
    message = attestation_message(record, digest)
    assert key.verify(KeyPurpose.IMPORT_ATTESTATION, message, meta[ATTESTATION])
    assert not WorkflowKey.generate().verify(
        KeyPurpose.IMPORT_ATTESTATION, message, meta[ATTESTATION]
    )
    # its ε is dp_accounting's for the history's one phase
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(
        dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(rate, dp_event.GaussianDpEvent(SIGMA)), steps
        )
    )
    assert loaded.candidate_privacy["epsilon_pld"] == pytest.approx(
        accountant.get_epsilon(DELTA), abs=1e-5
    )


@pytest.mark.parametrize(
    ("suffix", "profile", "kind"),
    [
        (".safetensors", RECORD_PROFILE, ProfileKind.RECORD),
        (".pt", RDP_PROFILE, ProfileKind.RDP),
        (".pth", EPS_DELTA_PROFILE, ProfileKind.EPSILON_DELTA),
    ],
)
def test_each_weights_format_and_profile_kind(tmp_path, data, spec, suffix, profile, kind) -> None:
    weights = _state_dict(spec)
    path = tmp_path / f"w{suffix}"
    if suffix == ".safetensors":
        save_file(weights, str(path))
    else:
        torch.save(weights, path)
    result = _import(tmp_path, path, profile, data, spec)
    assert result.profile == kind
    loaded = read_candidate_dir(result.path)
    assert all(torch.equal(loaded.weights[k], v) for k, v in weights.items())
    if kind == ProfileKind.EPSILON_DELTA:  # the pair at the smallest δ
        assert (loaded.record.epsilon, loaded.record.delta) == (1.5, 1e-7)
    if kind == ProfileKind.RDP:
        assert loaded.record.rdp_epsilons == tuple(RDP_PROFILE["epsilons"])


@pytest.mark.parametrize("profile", [RECORD_PROFILE, RDP_PROFILE, EPS_DELTA_PROFILE])
def test_a_profile_states_where_training_started_or_the_import_starts_from_its_own(
    tmp_path, data, spec, profile
) -> None:
    path = tmp_path / "w.pt"
    torch.save(_state_dict(spec), path)
    silent = read_candidate_dir(_import(tmp_path, path, profile, data, spec, name="a").path)
    assert silent.record.initialisation is None
    stated = {**profile, "initialisation": "seed-0"}
    said = read_candidate_dir(_import(tmp_path, path, stated, data, spec, name="b").path)
    assert said.record.initialisation == "seed-0"
    assert initialisation_conflict([silent.record, said.record]) is not None
    with pytest.raises(RecordError, match="initialisation"):
        _import(tmp_path, path, {**profile, "initialisation": 0}, data, spec, name="c")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"epsilons": [0.1, -0.2, 0.4, 0.8, 1.6]}, "negative"),
        ({"epsilons": [0.1, 0.3, 0.2, 0.8, 1.6]}, "non-decreasing in α"),
        ({"epsilons": [0.1, 0.2, 0.4, 0.8, float("inf")]}, "not finite"),
        ({"epsilons": [0.1, 0.2, True, 0.8, 1.6]}, "not a number"),
        ({"orders": [2.0, 4.0]}, "2 orders but 5 epsilons"),
    ],
)
def test_a_contradictory_rdp_curve_is_refused(tmp_path, data, spec, change, message) -> None:
    path = tmp_path / "w.pt"
    torch.save(_state_dict(spec), path)
    with pytest.raises(RecordError, match=message):
        _import(tmp_path, path, {**RDP_PROFILE, **change}, data, spec)
    assert not (tmp_path / "imp").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"epsilons": [1.0, 1.5, 0.8]}, "ε rises"),
        ({"deltas": [1e-7, 1e-6, 1.0]}, r"\(0, 1\)"),
        ({"deltas": [1e-6, 1e-6, 1e-5]}, "once"),
        ({"epsilons": [float("nan"), 1.0, 0.8]}, "not finite"),
    ],
)
def test_a_contradictory_epsilon_delta_curve_is_refused(
    tmp_path, data, spec, change, message
) -> None:
    path = tmp_path / "w.pt"
    torch.save(_state_dict(spec), path)
    with pytest.raises(RecordError, match=message):
        _import(tmp_path, path, {**EPS_DELTA_PROFILE, **change}, data, spec)


def test_bad_weights_and_profiles_are_refused(tmp_path, data, spec, opacus_checkpoint) -> None:
    weights = _state_dict(spec)
    wrong = {k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) for k, v in weights.items()}
    torch.save(wrong, tmp_path / "wrong.pt")
    with pytest.raises(RecordError, match="wrong shape"):
        _import(tmp_path, tmp_path / "wrong.pt", RECORD_PROFILE, data, spec)
    torch.save({**weights, "extra": torch.zeros(1)}, tmp_path / "extra.pt")
    with pytest.raises(RecordError, match="unexpected"):
        _import(tmp_path, tmp_path / "extra.pt", RECORD_PROFILE, data, spec)
    torch.save({k: v.double() for k, v in weights.items()}, tmp_path / "double.pt")
    with pytest.raises(RecordError, match=r"expected torch\.float32"):
        _import(tmp_path, tmp_path / "double.pt", RECORD_PROFILE, data, spec)
    torch.save(weights, tmp_path / "w.pt")
    missing = {k: v for k, v in RECORD_PROFILE.items() if k != "clip_norm"}
    with pytest.raises(RecordError, match="clip_norm"):
        _import(tmp_path, tmp_path / "w.pt", missing, data, spec)
    with pytest.raises(RecordError, match="'profile' must be one of"):
        _import(tmp_path, tmp_path / "w.pt", {**RECORD_PROFILE, "profile": "gdp"}, data, spec)
    with pytest.raises(RecordError, match="unknown field 'epsilon'"):
        _import(tmp_path, tmp_path / "w.pt", {**RECORD_PROFILE, "epsilon": 1.0}, data, spec)
    with pytest.raises(RecordError, match="needs an Opacus checkpoint"):
        _import(tmp_path, tmp_path / "w.pt", OPACUS_PROFILE, data, spec)
    with pytest.raises(RecordError, match="only 'poisson'"):
        _import(tmp_path, tmp_path / "w.pt", {**RECORD_PROFILE, "sampling": "shuffle"}, data, spec)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RecordError, match="not a readable safetensors"):
        _import(tmp_path, tmp_path / "junk.safetensors", RECORD_PROFILE, data, spec)
    checkpoint = torch.load(opacus_checkpoint[0], weights_only=False)
    history = checkpoint["privacy_accountant_state_dict"]["history"]
    checkpoint["privacy_accountant_state_dict"]["history"] = [*history, (2.0, 0.1, 5)]
    torch.save(checkpoint, tmp_path / "phases.pt")
    with pytest.raises(RecordError, match="2 phases"):
        _import(tmp_path, tmp_path / "phases.pt", OPACUS_PROFILE, data, spec)
    assert not (tmp_path / "imp").exists()


def _label_pld(label: PrivacyLabel):
    return pld_lib.from_privacy_parameters(
        pld_lib.common.DifferentialPrivacyParameters(label.epsilon, label.delta),
        value_discretization_interval=1e-4,
    )


def test_lc_with_imported_profiles_is_the_composition_dp_accounting_gives(tmp_path) -> None:
    own = make_record("own", 1.5, dataset="d")
    rdp_label = PrivacyLabel(
        name="rdp", dataset="d", rdp_orders=(2.0, 4.0, 8.0, 16.0, 32.0),
        rdp_epsilons=(0.1, 0.2, 0.4, 0.8, 1.6), attested_by="Acme",
    )  # fmt: skip
    report = account([own, rdp_label], "lc", [0.5, 0.5], DELTA)
    # RDP: the record's curve plus the imported one at each order (+∞ where none is given),
    # converted by dp_accounting; an RDP-only label has no PLD
    orders = rdp_privacy_accountant.DEFAULT_RDP_ORDERS
    accountant = rdp_privacy_accountant.RdpAccountant(orders=orders)
    accountant.compose(own.dp_event())
    given = dict(zip(rdp_label.rdp_orders, rdp_label.rdp_epsilons, strict=True))
    total = [
        r + given.get(float(a), math.inf) for r, a in zip(accountant._rdp, orders, strict=True)
    ]
    expected, _ = rdp_privacy_accountant.compute_epsilon(orders, total, DELTA)
    assert report.generic.epsilon_rdp == pytest.approx(expected, rel=1e-9)
    assert report.gating.epsilon == pytest.approx(expected, rel=1e-9)
    # (ε, δ) label: the record's PLD composed with the label's worst-case PLD
    pair = PrivacyLabel(name="pair", dataset="d", epsilon=0.5, delta=1e-7, attested_by="Acme")
    report = account([own, pair], "lc", [0.5, 0.5], DELTA)
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(own.dp_event())
    composed = pld._pld.compose(_label_pld(pair))
    assert report.generic.epsilon_pld == pytest.approx(
        composed.get_epsilon_for_delta(DELTA), abs=1e-3
    )


def test_imported_runs_of_unknown_batches_are_one_shared_unit() -> None:
    """Two imported DP-SGD runs with unknown batches: σ_eff = (Σσ⁻²)^(−1/2) per step."""
    unknown = "unknown:d"
    a = make_record("a", 1.5, dataset="d", batch_lineage=unknown, sample_rate=0.01, steps=500)
    b = make_record("b", 2.0, dataset="d", batch_lineage=unknown, sample_rate=0.01, steps=500)
    a, b = (r.model_copy(update={"attested_by": "Acme"}) for r in (a, b))
    report = account([a, b], "lc", [0.5, 0.5], DELTA)
    sigma = (1.5**-2 + 2.0**-2) ** -0.5
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(
        dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(sigma)), 500
        )
    )
    assert report.generic.epsilon_pld == pytest.approx(accountant.get_epsilon(DELTA), abs=2e-3)
    assert any("one release unit" in line for line in report.attestations)
    c = b.model_copy(update={"name": "c", "sample_rate": 0.02})
    with pytest.raises(RefusalError, match="unknown batches and different sample rates"):
        account([a, c], "lc", [0.5, 0.5], DELTA)


def test_rs_with_an_imported_profile_is_the_mixture_of_delta_curves() -> None:
    own = make_record("own", 1.5, dataset="d")
    pair = PrivacyLabel(name="pair", dataset="d", epsilon=0.5, delta=1e-6, attested_by="Acme")
    weights = [0.3, 0.7]
    report = account([own, pair], "rs", weights, DELTA)
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(own.dp_event())
    curves = [pld._pld, _label_pld(pair)]

    def excess(epsilon: float) -> float:
        mixed = sum(
            w * c.get_delta_for_epsilon(epsilon) for w, c in zip(weights, curves, strict=True)
        )
        return mixed - DELTA

    expected = optimize.brentq(excess, 1e-6, 20.0, xtol=1e-9)
    assert report.gating.epsilon_pld == pytest.approx(expected, abs=1e-4)


def test_imports_never_take_the_structured_bound_and_two_imported_labels_refuse_lc() -> None:
    own = make_record("own", 1.5, dataset="d")
    imported = make_record("ext", 2.0, dataset="d").model_copy(update={"attested_by": "Acme"})
    with pytest.raises(RefusalError, match="structured bound refused: candidate 'ext' is imported"):
        account([own, imported], "lc", [0.5, 0.5], DELTA, gating_bound="structured")
    first = PrivacyLabel(name="p1", dataset="d", epsilon=0.5, delta=1e-7, attested_by="Acme")
    second = first.model_copy(update={"name": "p2"})
    with pytest.raises(RefusalError, match="'p1', 'p2' may share batches and noise"):
        account([first, second], "lc", [0.5, 0.5], DELTA)
    report = account([first, second], "rs", [0.5, 0.5], DELTA)
    assert report.gating.epsilon > 0
    release = release_for("r1", [first, second], report)
    with pytest.raises(RefusalError, match="source's release ledger"):
        cumulative_bound([release], DELTA)  # the ledger holds at most one imported label


def test_the_cards_say_in_bold_who_attested() -> None:
    own = make_record("own", 1.5, dataset="d")
    pair = PrivacyLabel(name="pair", dataset="d", epsilon=0.5, delta=1e-7, attested_by="Acme")
    lines = assumption_lines(account([own, pair], "lc", [0.5, 0.5], DELTA).to_dict())
    assert "**record attested by Acme, not produced by dpmerge's training**" in lines
    assert not any("attested" in line for line in assumption_lines(
        account([own, pair], "lc", [1.0, 0.0], DELTA).to_dict()
    ))  # fmt: skip


def test_the_cli_imports_and_lists(tmp_path, capsys, spec) -> None:
    torch.save(_state_dict(spec), tmp_path / "w.pt")
    profile = _profile(tmp_path, RECORD_PROFILE)
    args = [
        "candidates", "import", str(tmp_path / "w.pt"), "--profile", str(profile),
        "--model", "logreg", "--dataset", "digits", "--name", "ext", "--attested-by", "Acme",
    ]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "ext"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["profile"] == "record" and shown["weights_format"] == "state_dict"
    assert shown["weights_sha256"] == weights_digest(read_candidate_dir(tmp_path / "ext").weights)
    assert main(["candidates", "list", str(tmp_path / "ext")]) == 0
    listed = json.loads(capsys.readouterr().out)["candidates"]
    assert listed[0]["attested_by"] == "Acme" and listed[0]["noise_multiplier"] == 1.5
    args[args.index("logreg")] = "bogus"
    assert main([*args, "--out", str(tmp_path / "bogus")]) == 2
    assert "'bogus' is neither a built-in model nor module:callable" in capsys.readouterr().err
    assert not (tmp_path / "bogus").exists()


FACTORY = """from torch import nn
def mlp(input_shape, classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, classes))
"""


def test_the_cli_imports_a_model_of_your_factory(tmp_path, capsys, data) -> None:
    """``--model module:callable --model-path DIR``: the weights are checked against the
    factory's module and the candidate records the factory's source digest, as a trained one
    does; the factory's options with a built-in model, and a transformer, are refused in one
    line, nothing written."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "ownnets.py").write_text(FACTORY)
    code = str(tmp_path / "code")
    spec = model_spec("ownnets:mlp", data, model_path=code)
    torch.save(_state_dict(spec), tmp_path / "w.pt")
    profile = _profile(tmp_path, RECORD_PROFILE)
    args = [
        "candidates", "import", str(tmp_path / "w.pt"), "--profile", str(profile),
        "--dataset", "digits", "--name", "ext", "--attested-by", "Acme",
    ]  # fmt: skip
    model = ["--model", "ownnets:mlp", "--model-path", code]
    assert main([*args, *model, "--out", str(tmp_path / "ext")]) == 0, capsys.readouterr().err
    imported = read_candidate_dir(tmp_path / "ext")
    assert imported.spec.factory is not None and imported.spec.factory == spec.factory
    assert imported.record.attested_by == "Acme"
    wrong = _state_dict(model_spec("logreg", data))
    torch.save(wrong, tmp_path / "logreg.pt")
    capsys.readouterr()
    bad = [*args[:2], str(tmp_path / "logreg.pt"), *args[3:]]
    assert main([*bad, *model, "--out", str(tmp_path / "wrong")]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not (tmp_path / "wrong").exists()
    for refused, message in (
        (["--model", "logreg", "--model-path", code], "model_path applies only to a model"),
        (["--model", "logreg", "--fix-model"], "fix_model applies only to a model factory"),
        (["--model", "transformers"], "not a fine-tuned transformer"),
    ):
        assert main([*args, *refused, "--out", str(tmp_path / "no")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert not (tmp_path / "no").exists()


def test_only_the_workflow_identity_imports() -> None:
    """An environment without the workflow key (an operator's or consumer's shell) is refused."""
    from types import SimpleNamespace

    from dpmerge.errors import AccessError
    from dpmerge.importing import importer_key

    with pytest.raises(AccessError, match="only the workflow identity imports"):
        importer_key(SimpleNamespace(workflow_key=lambda: None))
    key = WorkflowKey.generate()
    assert importer_key(SimpleNamespace(workflow_key=lambda: key)) is key


def test_the_ledger_counts_an_import_under_its_dataset_identity() -> None:
    own = make_record("own", 1.5, dataset="d")
    ext = make_record("ext", 2.0, dataset="d").model_copy(update={"attested_by": "Acme"})
    release = release_for("r", [own, ext], account([own, ext], "rs", [0.5, 0.5], DELTA))
    assert release.dataset == "d" and {c.name for c in release.candidates} == {"own", "ext"}
    joint = account([own, ext], "lc", [0.5, 0.5], DELTA).generic
    assert cumulative_bound([release], DELTA).epsilon == pytest.approx(joint.epsilon)
