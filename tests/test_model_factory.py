"""A model of the user's own (docs/design.md#your-model): a factory ``module:callable`` written
outside the repository, trained for a few steps, two candidates merged by LC and the merge
evaluated through the same factory; every bad input refused in one line with nothing written."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

import dpmerge.cli
from dpmerge.artifacts import FactoryRecord, ModelSpec, load_model_dir
from dpmerge.registry.names import candidate_model_name

FACTORIES = """
import math

from torch import nn


def make(input_shape, classes):
    width = math.prod(input_shape)
    return nn.Sequential(nn.Flatten(), nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, classes))


def batchnorm(input_shape, classes):
    width = math.prod(input_shape)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(width, 16), nn.BatchNorm1d(16), nn.Linear(16, classes)
    )


def raises(input_shape, classes):
    raise RuntimeError("no such layer size")


def not_module(input_shape, classes):
    return 42


def wrong_width(input_shape, classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), classes + 1))


def frozen(input_shape, classes):
    model = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), classes))
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


VALUE = 3
"""
TRAIN = ("--dataset", "digits", "--limit", "150", "--noise-multiplier", "1.0")
TRAIN += ("--delta", "1e-4", "--batch-size", "32", "--max-steps", "3", "--no-progress")
MERGE = ("merge", "--json", "--method", "lc", "--weights", "0.5,0.5", "--inputs")


@pytest.fixture
def user_code(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A directory outside the repository holding a factory module of a fresh name."""
    folder = tmp_path_factory.mktemp("user-code")
    module = f"user_models_{uuid.uuid4().hex[:8]}"
    (folder / f"{module}.py").write_text(FACTORIES)
    return folder, module


def train(folder: Path, model: str, out: Path, *extra: str) -> int:
    args = ["train", *TRAIN, "--model", model, "--model-path", str(folder), "--out", str(out)]
    return dpmerge.cli.main([*args, *extra])


def test_a_factory_trains_merges_and_evaluates_through_itself(
    user_code: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, module = user_code
    a, b = tmp_path / "a", tmp_path / "b"
    assert train(folder, f"{module}:make", a, "--seed", "1") == 0
    assert train(folder, f"{module}:make", b, "--seed", "2") == 0
    spec = load_model_dir(a).spec
    assert spec.factory is not None and spec.factory.reference == f"{module}:make"
    assert not spec.factory.fixed and len(spec.factory.sha256) == 64
    assert spec == load_model_dir(b).spec
    capsys.readouterr()

    merged = tmp_path / "lc"
    code = dpmerge.cli.main(
        [*MERGE, str(a), str(b), "--out", str(merged), "--dataset", "digits", "--limit", "150"]
    )
    assert code == 0, capsys.readouterr().err
    document = json.loads(capsys.readouterr().out)
    assert 0 <= document["metrics"]["test"]["accuracy"] <= 1
    assert load_model_dir(merged).spec == spec
    assert dpmerge.cli.main(["evaluate", str(merged), "--dataset", "digits", "--limit", "150"]) == 0
    capsys.readouterr()

    fixed = tmp_path / "fixed"
    assert train(folder, f"{module}:batchnorm", fixed, "--fix-model") == 0
    assert load_model_dir(fixed).spec.factory.fixed  # type: ignore[union-attr]
    capsys.readouterr()
    refused = tmp_path / "mixed"
    code = dpmerge.cli.main([*MERGE, str(a), str(fixed), "--out", str(refused)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "model factories differ" in err
    assert not refused.exists()

    source = folder / f"{module}.py"
    source.write_text(source.read_text() + "\n# edited\n")
    code = dpmerge.cli.main(["evaluate", str(merged), "--dataset", "digits", "--limit", "150"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "source changed" in err


@pytest.mark.parametrize(
    ("model", "extra", "said"),
    [
        (
            "not-a-model",
            (),
            "unknown model 'not-a-model'; known: logreg, cnn, resnet18_gn, transformers, or",
        ),
        ("a:b:c", (), "neither a built-in model nor module:callable"),
        ("no_such_module_9f3e:make", (), "not found on sys.path"),
        ("{module}:absent", (), "has no 'absent'"),
        ("{module}:VALUE", (), "is not callable (a int)"),
        ("{module}:raises", (), "raised RuntimeError: no such layer size"),
        ("{module}:not_module", (), "returned a int, not a torch.nn.Module"),
        ("{module}:wrong_width", (), "is shape (2, 11), expected (2, 10) for 10 classes"),
        ("{module}:frozen", (), "no trainable parameters"),
        ("{module}:batchnorm", (), "Opacus refuses the module (--fix-model applies"),
    ],
)
def test_a_bad_factory_is_refused_in_one_line_with_nothing_trained(
    user_code: tuple[Path, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    model: str,
    extra: tuple[str, ...],
    said: str,
) -> None:
    folder, module = user_code
    out = tmp_path / "out"
    assert train(folder, model.format(module=module), out, *extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err and "Traceback" not in err
    assert not out.exists()


def test_factory_options_are_refused_with_a_built_in_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert (
        dpmerge.cli.main(["train", *TRAIN, "--model", "logreg", "--fix-model", "--out", str(out)])
        == 2
    )
    err = capsys.readouterr().err
    assert "fix_model applies only to a model factory" in err and err.count("\n") == 1
    assert not out.exists()


def test_registered_names_keep_factories_and_their_sources_apart() -> None:
    def spec(reference: str, sha256: str) -> ModelSpec:
        return ModelSpec(reference, (1, 8, 8), 10, FactoryRecord(reference, sha256, False))

    dataset = "digits-hmac:0123456789abcdef"
    names = {
        candidate_model_name(dataset, s.label)
        for s in (
            ModelSpec("logreg", (1, 8, 8), 10),
            spec("mine:make", "a" * 64),
            spec("mine:make", "b" * 64),
            spec("a_very_long_package_name.with_modules:and_a_long_factory_name", "c" * 64),
        )
    }
    assert len(names) == 4
    assert any("factory-cccccccc-" in name for name in names)
    assert ModelSpec.from_dict(spec("mine:make", "a" * 64).to_dict()) == spec("mine:make", "a" * 64)


def test_a_package_factory_is_digested_whole_and_an_edit_is_reimported(
    tmp_path: Path,
) -> None:
    """A package's digest covers each of its ``.py`` files; an edited source in the same
    process gives a new digest and is imported again (not the stale module)."""
    from dpmerge.errors import ModelFactoryError
    from dpmerge.model_factory import check_factory

    package = tmp_path / f"user_pkg_{uuid.uuid4().hex[:8]}"
    package.mkdir()
    (package / "__init__.py").write_text("from .nets import make\n")
    (package / "nets.py").write_text(FACTORIES)
    first = check_factory(f"{package.name}:make", (1, 8, 8), 10, model_path=str(tmp_path))
    assert first.path == str(tmp_path.resolve()) and not first.fixed
    (package / "nets.py").write_text(FACTORIES.replace("classes + 1", "classes + 2"))
    assert not list(package.rglob("*.pyc"))  # nothing written beside the user's code
    second = check_factory(f"{package.name}:make", (1, 8, 8), 10, model_path=str(tmp_path))
    assert second.sha256 != first.sha256 and second != first
    (package / "__init__.py").write_text("from .nets import wrong_width as make\n")
    with pytest.raises(ModelFactoryError, match=r"is shape \(2, 12\), expected \(2, 10\)"):
        check_factory(f"{package.name}:make", (1, 8, 8), 10, model_path=str(tmp_path))


def test_the_training_flow_passes_the_factory_and_its_path_to_workers() -> None:
    """``train-candidates`` takes ``model_path`` and ``fix_model`` as parameters and hands them
    to each ``train-candidate`` run (a worker imports the factory from that path)."""
    import inspect

    from flows.training import plan_candidates, train_candidates

    assert {"model_path", "fix_model"} <= set(inspect.signature(train_candidates).parameters)
    (spec,) = plan_candidates(
        "digits", "mine:make", [1.0], None, model_path="/srv/user-code", fix_model=True
    )
    parameters = spec.parameters()
    assert parameters["model"] == "mine:make" and parameters["model_path"] == "/srv/user-code"
    assert parameters["fix_model"] is True and ":" not in spec.name
