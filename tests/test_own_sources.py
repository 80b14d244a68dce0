"""Datasets of your own beyond the table (docs/design.md#your-data): an image folder, a NumPy
``.npz`` and a saved Hugging Face dataset, each split by the keyed hash of its unit ids
(dpmerge.data.own), named by its identity, keyed in the one ``own`` ledger source, and each bad
input refused in one line before anything is trained."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
from PIL import Image

import dpmerge.cli
from dpmerge.data import load_dataset
from dpmerge.data.datasets import preprocessing
from dpmerge.data.own import DEFAULT_FRACTIONS, DEFAULT_SPLIT_KEY, split_of, split_units
from dpmerge.errors import DatasetError
from dpmerge.state.serving import source_of
from dpmerge.vocabulary import SplitName

UNITS = 60


def spec(folder: Path, **declared: object) -> Path:
    path = folder / "spec.json"
    path.write_text(json.dumps(declared))
    return path


def images(folder: Path) -> Path:
    """Class ``dark`` images are darker than class ``bright`` ones; the spec's path."""
    rng = np.random.default_rng(3)
    for name, base in (("dark", 40), ("bright", 200)):
        (folder / "imgs" / name).mkdir(parents=True, exist_ok=True)
        for i in range(UNITS // 2):
            pixels = (base + rng.integers(-30, 30, size=(6, 5))).astype(np.uint8)
            Image.fromarray(pixels).save(folder / "imgs" / name / f"{i:03}.png")
    return spec(folder, path="imgs", classes=["dark", "bright"], size=[6, 5], mode="L")


def arrays(rows: int = UNITS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(rows, 2, 3)).astype(np.float32)
    return {"x": x, "y": (x[:, 0, 0] > 0).astype(np.int64), "who": np.arange(rows) + 1000}


def npz(folder: Path, data: dict[str, np.ndarray] | None = None) -> Path:
    np.savez(folder / "d.npz", **(arrays() if data is None else data))
    return spec(folder, path="d.npz", features="x", label="y", classes=[0, 1], unit="who")


def saved(folder: Path, columns: dict[str, list] | None = None) -> Path:
    rng = np.random.default_rng(9)
    b = rng.normal(size=UNITS)
    columns = columns or {
        "user": [f"p{i}" for i in range(UNITS)],
        "a": list(np.arange(UNITS) / 100),
        "b": list(b),
        "y": [int(v > 0) for v in b],
    }
    datasets.Dataset.from_dict(columns).save_to_disk(str(folder / "hf"))
    keys = {"path": "hf", "features": ["a", "b"], "label": "y", "classes": [0, 1]}
    return spec(folder, **keys, unit="user")


MAKERS = {"image-folder": images, "npz": npz, "hf-dataset": saved}
SHAPES = {"image-folder": (1, 6, 5), "npz": (2, 3), "hf-dataset": (2,)}


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_each_source_splits_its_units_by_the_keyed_hash(tmp_path: Path, kind: str) -> None:
    data = load_dataset(kind, MAKERS[kind](tmp_path))
    assert len(data.train) + len(data.validation) + len(data.test) == UNITS
    assert data.dataset_size == len(data.train) > 0
    assert data.input_shape == SHAPES[kind] and data.num_classes == 2
    assert data.fingerprint.startswith(f"{kind}-sha256:")
    assert preprocessing(kind).startswith("float32 array (n, ")
    assert source_of(data.fingerprint) == source_of("table-sha256:00") == "own"
    assert load_dataset(kind, tmp_path / "spec.json").fingerprint == data.fingerprint
    keyed = json.loads((tmp_path / "spec.json").read_text()) | {"split_key": "another"}
    (tmp_path / "spec.json").write_text(json.dumps(keyed))
    assert load_dataset(kind, tmp_path / "spec.json").fingerprint != data.fingerprint


def test_units_are_files_and_array_ids(tmp_path: Path) -> None:
    data = load_dataset("image-folder", images(tmp_path))
    files = [f"{c}/{i:03}.png" for c in ("dark", "bright") for i in range(UNITS // 2)]
    splits = split_units(files, DEFAULT_SPLIT_KEY, DEFAULT_FRACTIONS)
    sizes = (len(data.train), len(data.validation), len(data.test))
    assert sizes == tuple(int((splits == name).sum()) for name in SplitName)
    data = load_dataset("npz", npz(tmp_path))
    picked = [
        i
        for i in range(UNITS)
        if split_of(str(1000 + i), DEFAULT_SPLIT_KEY, DEFAULT_FRACTIONS) == SplitName.TRAIN
    ]
    assert np.array_equal(data.train.features.numpy(), arrays()["x"][picked])


def test_an_image_folder_identity_covers_every_file_path_and_byte(tmp_path: Path) -> None:
    path = images(tmp_path)
    before = load_dataset("image-folder", path).fingerprint
    image = tmp_path / "imgs" / "dark" / "004.png"
    pixels = np.asarray(Image.open(image)).copy()
    pixels[0, 0] ^= 1
    Image.fromarray(pixels).save(image)
    changed = load_dataset("image-folder", path).fingerprint
    image.rename(image.with_name("104.png"))
    renamed = load_dataset("image-folder", path).fingerprint
    assert len({before, changed, renamed}) == 3


def test_table_fingerprint_is_unchanged_by_the_shared_machinery(tmp_path: Path) -> None:
    """The identity of a table computed before dpmerge.data.own existed."""
    rows = "".join(f"u{i},{i / 1000},{(-1) ** i * (i % 7) / 3:.4f},{i % 2}\n" for i in range(60))
    (tmp_path / "t.csv").write_text("user,a,b,y\n" + rows)
    path = spec(tmp_path, path="t.csv", features=["a", "b"], label="y", classes=[0, 1], unit="user")
    assert (
        load_dataset("table", path).fingerprint == "table-sha256:63586ed61246ce45e20a85d29133cfd0"
    )
    limited = load_dataset("table", path, limit=50).fingerprint
    assert limited == "table-sha256:1f6b524ee3d443f5087959f791285693"


def _bad_images(folder: Path, change: str) -> str:
    images(folder)
    root = folder / "imgs"
    if change == "undecodable image":
        (root / "dark" / "007.png").write_bytes(b"not a png")
        return f"{root / 'dark' / '007.png'}: the image does not decode"
    if change == "wrong size":
        Image.new("L", (4, 4)).save(root / "bright" / "002.png")
        return f"{root / 'bright' / '002.png'}: a L image of 4x4, but the spec declares L 6x5"
    if change == "undeclared class":
        (root / "other").mkdir()
        return f"{root / 'other'}: not a declared class sub-folder"
    if change == "one class":
        for path in (root / "bright").iterdir():
            path.unlink()
        return f"{root}: only the class sub-folder 'dark' holds images"
    assert change == "empty"
    for path in [*(root / "bright").iterdir(), *(root / "dark").iterdir()]:
        path.unlink()
    return f"{root}: no images"


def _bad_npz(folder: Path, change: str) -> str:
    data = arrays()
    where = str(folder / "d.npz")
    if change == "missing array":
        del data["who"]
        message = f"{where}: missing array 'who'"
    elif change == "extra array":
        data["z"] = np.zeros(UNITS)
        message = f"{where}: array 'z' is not declared"
    elif change == "non-numeric":
        data["x"] = data["x"].astype(str)
        message = f"{where}: array 'x': not numbers"
    elif change == "NaN":
        data["x"][4, 1, 2] = np.nan
        message = f"{where}: array 'x', row 5: not finite"
    elif change == "one class":
        data["y"][:] = 1
        message = f"{where}: array 'y' holds one class only"
    elif change == "duplicate unit id":
        data["who"][9] = data["who"][2]
        message = f"{where}: array 'who', row 10: unit '1002' also holds row 3"
    else:
        assert change == "empty"
        data = {k: v[:0] for k, v in data.items()}
        message = f"{where}: no rows"
    npz(folder, data)
    return message


def test_a_folder_that_is_not_one_saved_dataset_is_refused(tmp_path: Path) -> None:
    path = saved(tmp_path)
    for file in (tmp_path / "hf").iterdir():
        file.unlink()
    (tmp_path / "hf" / "notes.txt").write_text("not a dataset")
    with pytest.raises(DatasetError, match=r"/hf: not a saved dataset \(Directory"):
        load_dataset("hf-dataset", path)
    parts = {"train": datasets.Dataset.from_dict({"a": [1.0], "b": [2.0], "y": [0]})}
    datasets.DatasetDict(parts).save_to_disk(str(tmp_path / "dict"))
    path.write_text(path.read_text().replace('"hf"', '"dict"'))
    with pytest.raises(DatasetError, match=r"/dict: a DatasetDict \(train\); save one Dataset"):
        load_dataset("hf-dataset", path)


def _bad_saved(folder: Path, change: str) -> str:
    columns = {
        "user": [f"p{i}" for i in range(UNITS)],
        "a": [0.5] * UNITS,
        "b": [1.0] * UNITS,
        "y": [i % 2 for i in range(UNITS)],
    }
    where = str(folder / "hf")
    if change == "missing column":
        del columns["b"]
        message = f"{where}: missing column 'b'"
    elif change == "extra column":
        columns["z"] = [1.0] * UNITS
        message = f"{where}: column 'z' is not declared"
    elif change == "non-numeric":
        columns["a"] = ["x"] * UNITS
        message = f"{where}: column 'a', row 1: not a number ('x')"
    elif change == "NaN":
        columns["b"][3] = None
        message = f"{where}: column 'b', row 4: empty cell"
    elif change == "one class":
        columns["y"] = [0] * UNITS
        message = f"{where}: column 'y' holds one class only"
    elif change == "duplicate unit id":
        columns["user"][7] = "p1"
        message = f"{where}: column 'user', row 8: unit 'p1' also holds row 2"
    else:
        assert change == "empty"
        columns = {k: [] for k in columns}
        message = f"{where}: no rows"
    saved(folder, columns)
    return message


BAD = {
    "image-folder": (
        _bad_images,
        ["undecodable image", "wrong size", "undeclared class", "one class", "empty"],
    ),
    "npz": (
        _bad_npz,
        [
            "missing array",
            "extra array",
            "non-numeric",
            "NaN",
            "one class",
            "duplicate unit id",
            "empty",
        ],
    ),
    "hf-dataset": (
        _bad_saved,
        [
            "missing column",
            "extra column",
            "non-numeric",
            "NaN",
            "one class",
            "duplicate unit id",
            "empty",
        ],
    ),
}
CASES = [(kind, change) for kind, (_, changes) in sorted(BAD.items()) for change in changes]


@pytest.mark.parametrize(("kind", "change"), CASES)
def test_bad_input_is_one_line_naming_file_and_place(
    tmp_path: Path, kind: str, change: str
) -> None:
    expected = BAD[kind][0](tmp_path, change)
    with pytest.raises(DatasetError) as refused:
        load_dataset(kind, tmp_path / "spec.json")
    message = str(refused.value)
    assert "\n" not in message and message.startswith(expected), message


def train(kind: str, spec_path: Path, out: Path) -> int:
    return dpmerge.cli.main(
        [
            *("train", "--dataset", kind, "--data-root", str(spec_path), "--model", "logreg"),
            *("--noise-multiplier", "1.0", "--delta", "1e-3", "--batch-size", "16"),
            *("--epochs", "1", "--out", str(out), "--no-progress", "--json"),
        ]
    )


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_train_records_the_source_identity_and_n(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    data = load_dataset(kind, MAKERS[kind](tmp_path))
    capsys.readouterr()
    assert train(kind, tmp_path / "spec.json", tmp_path / "cand") == 0
    summary = json.loads(capsys.readouterr().out)
    record = json.loads((tmp_path / "cand" / "record.json").read_text())["record"]
    assert record["dataset"] == summary["dataset"] == data.fingerprint
    assert record["dataset_size"] == summary["dataset_size"] == data.dataset_size


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_train_on_bad_input_exits_2_and_writes_nothing(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = BAD[kind][0](tmp_path, BAD[kind][1][0])
    capsys.readouterr()  # datasets' progress bar while the test saves its data
    assert train(kind, tmp_path / "spec.json", tmp_path / "cand") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and expected in err, err
    assert not (tmp_path / "cand").exists()
    assert train(kind, tmp_path / "absent.json", tmp_path / "cand") == 2
    assert "is not a file" in capsys.readouterr().err
