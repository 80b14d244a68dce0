"""A transformers model from a local directory, DP fine-tuned on a declared parameter subset
(docs/design.md#fine-tuning): a tiny random BERT saved on disk (nothing downloaded), LoRA and
named-layer candidates trained through the project's trainer, merged by LC over the trained
parameters only, the merge evaluated; and each bad input refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from opacus.validators import ModuleValidator
from transformers import AutoModelForSequenceClassification, BertConfig

import dpmerge.cli
from dpmerge.artifacts import load_model_dir
from dpmerge.data import DatasetSplits, load_dataset
from dpmerge.errors import BaseModelError, DatasetError, DifferentBasesError
from dpmerge.evaluation import evaluate
from dpmerge.fine_tuning import base_digest
from dpmerge.merging import merge_model_dirs
from dpmerge.training import TrainConfig, TrainingConfigError, save_candidate, train_candidate

DELTA = 1e-3
LAYERS = {"lora_rank": None, "lora_targets": None}
"""Settings that leave LoRA for named layers."""
VOCAB, LENGTH, ROWS = 100, 8, 240


def save_base(directory: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=LENGTH,
        num_labels=2,
    )
    AutoModelForSequenceClassification.from_config(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("transformer")
    save_base(root / "base", 0)
    (root / "not-a-model").mkdir()
    (root / "not-a-model" / "notes.txt").write_text("no config.json here")
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, size=(ROWS, LENGTH))
    mask = np.ones_like(ids)
    mask[:, -2:] = rng.integers(0, 2, size=(ROWS, 2))
    labels = rng.integers(0, 2, size=ROWS)
    ids[:, 0] = np.where(labels == 1, 7, 5)  # the first token decides the class
    np.savez(root / "tokens.npz", input_ids=ids, attention_mask=mask, labels=labels)
    return root


@pytest.fixture(scope="module")
def data(place: Path) -> DatasetSplits:
    return load_dataset("tokens", place / "tokens.npz")


def config(place: Path, **overrides: object) -> TrainConfig:
    settings: dict = dict(
        dataset="tokens",
        model="transformers",
        model_dir=str(place / "base"),
        lora_rank=2,
        lora_targets="query,value",
        noise_multiplier=0.5,
        batch_size=48,
        epochs=8,  # 32 steps: every noise seed of 28 tried reached test accuracy 1
        learning_rate=2.0,
        delta=DELTA,
    )
    settings.update(overrides)
    return TrainConfig(**settings)


def pld_epsilon(sigma: float, q: float, steps: int) -> float:
    accountant = PLDAccountant(value_discretization_interval=1e-4)
    event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
    accountant.compose(dp_event.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(DELTA)


def test_token_file_splits_by_unit_and_checks_its_arrays(place: Path, data: DatasetSplits) -> None:
    sizes = [len(data.train), len(data.validation), len(data.test)]
    assert sum(sizes) == ROWS and min(sizes) > 0
    assert data.input_shape == (2, LENGTH) and data.train.features.dtype == torch.int64
    assert data.fingerprint.startswith("tokens-sha256:")
    ids = np.load(place / "tokens.npz")["input_ids"]
    bad = place / "bad.npz"
    for arrays, message in (
        ({"input_ids": ids}, "missing array 'labels'"),
        ({"input_ids": ids, "labels": np.ones(ROWS, int)}, "at least two classes"),
        ({"input_ids": ids * 0.5, "labels": ids[:, 0] % 2}, "input_ids must be an integer"),
        ({"input_ids": ids, "labels": ids[:, 0] % 2, "unit_ids": ids[:, 0]}, "repeat a unit"),
    ):
        np.savez(bad, **arrays)
        with pytest.raises(DatasetError, match=message):
            load_dataset("tokens", bad)


def test_two_lora_candidates_merge_over_their_adapters(
    place: Path, data: DatasetSplits, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dirs = []
    for seed in (1, 2):
        result = train_candidate(config(place, noise_seed=seed), data)
        assert result.metrics["test_accuracy"] > 0.9  # the first token decides the class
        dirs.append(save_candidate(result, tmp_path / f"c{seed}", DELTA))
    record = result.record
    assert record.initialisation == f"base-{base_digest(place / 'base')}/seed-0"
    epsilon = load_model_dir(dirs[1]).candidate_privacy["epsilon_pld"]
    fresh = pld_epsilon(record.noise_multiplier, record.sample_rate, record.steps)
    assert fresh <= epsilon <= fresh + 1e-3
    first, second = (load_model_dir(d) for d in dirs)
    assert first.spec.fine_tune.base_digest == base_digest(place / "base")
    assert first.spec.fine_tune.base_dir == str((place / "base").resolve())
    assert set(first.tensors) == set(result.model.trained)
    assert ModuleValidator.validate(result.model, strict=True) == []
    assert all("lora_" in k or "modules_to_save" in k for k in first.tensors)
    merged = merge_model_dirs(
        dirs,
        "lc",
        [0.25, 0.75],
        tmp_path / "merged",
        delta=DELTA,
        metrics=lambda spec, weights: evaluate((spec, weights), data.test),
    )
    released = load_model_dir(merged.path)
    for key, tensor in released.weights.items():
        expected = 0.25 * first.weights[key] + 0.75 * second.weights[key]
        assert torch.allclose(tensor, expected, atol=1e-6)
    scores = evaluate((released.spec, released.weights), data.test)
    assert scores["n"] == len(data.test) and scores["accuracy"] > 0.9
    assert merged.metrics["accuracy"] == scores["accuracy"]
    evaluated = [*("evaluate", str(merged.path), "--dataset", "tokens"), "--json"]
    assert dpmerge.cli.main([*evaluated, "--data-root", str(place / "tokens.npz")]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == scores["accuracy"]


def test_named_layers_train_only_those_layers(
    place: Path, data: DatasetSplits, tmp_path: Path
) -> None:
    result = train_candidate(config(place, **LAYERS, train_layers="classifier,pooler"), data)
    assert result.metrics["test_accuracy"] > 0.9
    assert set(result.weights) == {
        f"model.{layer}.{kind}"
        for layer in ("classifier", "bert.pooler.dense")
        for kind in ("weight", "bias")
    }
    assert result.record.initialisation == f"base-{base_digest(place / 'base')}"
    out = save_candidate(result, tmp_path / "layers", DELTA)
    loaded = load_model_dir(out)
    assert evaluate((loaded.spec, loaded.weights), data.test)["n"] == len(data.test)


def test_a_changed_or_different_base_is_refused(
    place: Path, data: DatasetSplits, tmp_path: Path
) -> None:
    shutil.copytree(place / "base", tmp_path / "base")
    save_base(tmp_path / "other", 1)
    dirs = [
        save_candidate(
            train_candidate(config(tmp_path, model_dir=str(tmp_path / name), max_steps=1), data),
            tmp_path / f"c-{name}",
            DELTA,
        )
        for name in ("base", "other")
    ]
    with pytest.raises(DifferentBasesError, match=r"^different base models: .*c-other"):
        merge_model_dirs(dirs, "lc", [0.5, 0.5], tmp_path / "merged", delta=DELTA)
    assert not (tmp_path / "merged").exists()
    config_file = tmp_path / "base" / "config.json"
    config_file.write_text(config_file.read_text().replace("\n", "\n\n", 1))
    loaded = load_model_dir(dirs[0])
    with pytest.raises(BaseModelError, match=r"has digest sha256:.*but the record names"):
        evaluate((loaded.spec, loaded.weights), data.test)


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"model_dir": "absent"}, BaseModelError, "base model directory not found"),
        ({"model_dir": "not-a-model"}, BaseModelError, "is not a transformers sequence class"),
        ({"lora_targets": "query,nowhere"}, BaseModelError, "'nowhere' names no module"),
        (LAYERS | {"train_layers": "dropout"}, BaseModelError, "'dropout' names no module with"),
        (LAYERS | {"train_layers": "embeddings"}, BaseModelError, "position_embeddings' takes an"),
        ({"train_layers": "classifier"}, TrainingConfigError, "not both"),
        ({"model_dir": None}, TrainingConfigError, "needs model_dir"),
        ({"model": "cnn"}, TrainingConfigError, "model_dir applies only to model"),
    ],
)
def test_bad_fine_tune_inputs_are_one_line(
    place: Path, data: DatasetSplits, settings: dict, error: type, message: str
) -> None:
    if settings.get("model_dir"):  # a folder of the module's place
        settings = settings | {"model_dir": str(place / settings["model_dir"])}
    with pytest.raises(error, match=message) as raised:
        train_candidate(config(place, **settings), data)
    assert "\n" not in str(raised.value)


def test_cli_refuses_a_bad_target_in_one_line_and_writes_nothing(
    place: Path, data: DatasetSplits, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cand"
    code = dpmerge.cli.main(
        [
            *("train", "--dataset", "tokens", "--data-root", str(place / "tokens.npz")),
            *("--model", "transformers", "--model-dir", str(place / "base")),
            *("--lora-rank", "2", "--lora-targets", "nowhere", "--noise-multiplier", "1"),
            *("--delta", "1e-3", "--out", str(out), "--no-progress"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "'nowhere' names no module" in err, err
    assert not out.exists()
