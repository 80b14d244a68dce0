"""The architecture registry (dpmerge.models; docs/design.md#mechanism-record "initialisation",
§8.3–8.4)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from opacus.validators import ModuleValidator
from safetensors.torch import save_file

from dpmerge.artifacts import ModelSpec
from dpmerge.data import load_dataset
from dpmerge.errors import RecordError
from dpmerge.models import (
    MODEL_NAMES,
    build_model,
    check_weights_match,
    initialisation_id,
    load_pretrained,
    model_spec,
)
from dpmerge.vocabulary import ModelName

SHAPES = {"logreg": (1, 28, 28), "cnn": (1, 28, 28), "resnet18_gn": (3, 32, 32)}
BUILT_IN = [name for name in MODEL_NAMES if name != ModelName.TRANSFORMERS]
"""Architectures built from their spec alone (a transformer needs its base on disk:
tests/test_transformer.py)."""


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_architecture_is_valid_for_opacus_and_classifies(name: str) -> None:
    spec = ModelSpec(name, SHAPES[name], 10)
    model = build_model(spec, seed=1)
    assert ModuleValidator.validate(model, strict=True) == []
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert model(torch.rand(3, *SHAPES[name])).shape == (3, 10)
    check_weights_match(spec, model.state_dict())


def test_resnet18_gn_has_resnet18_size() -> None:
    model = build_model(ModelSpec("resnet18_gn", (3, 32, 32), 10))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(11.17e6, rel=0.01)


def test_initialisation_is_deterministic_per_seed_and_leaves_global_rng_alone() -> None:
    spec = ModelSpec("cnn", (1, 8, 8), 10)
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = (build_model(spec, seed=s).state_dict() for s in (5, 5, 6))
    assert torch.rand(1).item() == expected_next.item()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["head.weight"], c["head.weight"])
    assert initialisation_id(spec, 5) == "seed-5"


def test_logreg_starts_at_zero_whatever_the_seed() -> None:
    spec = ModelSpec("logreg", (1, 8, 8), 10)
    assert all(float(v.abs().sum()) == 0 for v in build_model(spec, seed=9).state_dict().values())
    assert initialisation_id(spec, 9) == initialisation_id(spec, 1) == "zeros"


def test_model_spec_follows_the_dataset() -> None:
    data = load_dataset("digits", limit=100)
    assert model_spec("cnn", data) == ModelSpec("cnn", (1, 8, 8), 10)
    with pytest.raises(RecordError, match="unknown model 'mlp'"):
        model_spec("mlp", data)


def test_check_weights_match_names_missing_extra_and_wrong_shapes() -> None:
    spec = ModelSpec("cnn", (1, 28, 28), 10)
    weights = build_model(spec).state_dict()
    with pytest.raises(RecordError, match=r"wrong shape head\.weight \(10, 128\)"):
        check_weights_match(spec, build_model(ModelSpec("cnn", (1, 8, 8), 10)).state_dict())
    missing = {k: v for k, v in weights.items() if k != "head.bias"}
    with pytest.raises(RecordError, match=r"missing head\.bias"):
        check_weights_match(spec, missing)
    with pytest.raises(RecordError, match=r"unexpected extra"):
        check_weights_match(spec, {**weights, "extra": torch.zeros(1)})
    with pytest.raises(RecordError, match="do not belong to cnn"):
        check_weights_match(spec, build_model(ModelSpec("logreg", (1, 28, 28), 10)).state_dict())


def test_pretrained_checkpoint_initialises_and_is_identified_by_hash(tmp_path: Path) -> None:
    spec = ModelSpec("cnn", (1, 8, 8), 10)
    public = build_model(spec, seed=42).state_dict()
    path = tmp_path / "public.safetensors"
    save_file(public, str(path))
    model, init_id = load_pretrained(spec, path)
    assert init_id == "checkpoint:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert all(torch.equal(model.state_dict()[k], public[k]) for k in public)
    save_file(build_model(ModelSpec("logreg", (1, 8, 8), 10)).state_dict(), str(path))
    with pytest.raises(RecordError, match="do not belong to cnn"):
        load_pretrained(spec, path)
    with pytest.raises(RecordError, match="not found"):
        load_pretrained(spec, tmp_path / "absent.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(RecordError, match="not a safetensors file"):
        load_pretrained(spec, tmp_path / "junk.safetensors")
