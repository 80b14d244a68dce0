"""A folder of images in class sub-folders, named by a spec file (docs/design.md#your-data).

The spec declares the folder (``path``), the classes (its sub-folders' names, in the model's
output order), the images' ``size`` ``[height, width]`` and ``mode`` (``L`` grey or ``RGB``),
and the common split keys (:mod:`dpmerge.data.own`). One file is one unit, its id the path
under the folder (``cat/0001.png``). Pixels are divided by 255 into (C, H, W) float32; an image
of another size or mode is refused, not resized or converted, and so is one that pillow cannot
decode, each naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpmerge.data import own
from dpmerge.data.splits import DatasetSplits
from dpmerge.errors import DatasetError
from dpmerge.vocabulary import DatasetName

SPEC_KEYS = (own.COMMON_KEYS - {"unit"}) | {"size", "mode"}
REQUIRED_KEYS = ("path", "classes", "size", "mode")
CHANNELS = {"L": 1, "RGB": 3}
"""The image modes accepted, with their channel counts."""


@dataclass(frozen=True)
class ImageSpec(own.OwnSpec):
    """A checked spec of an image folder: its declared image size and mode."""

    size: tuple[int, int]
    mode: str

    def declared(self) -> dict[str, Any]:
        return {"size": self.size, "mode": self.mode}


def read_spec(spec_path: str | Path) -> ImageSpec:
    """The spec at ``spec_path``, checked; the folder's ``path`` is relative to the spec file."""
    spec_path = Path(spec_path)
    raw = own.read_mapping(spec_path, DatasetName.IMAGE_FOLDER, SPEC_KEYS, REQUIRED_KEYS)
    size, mode = raw["size"], raw["mode"]
    sizes = isinstance(size, list) and len(size) == 2
    if not sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size):
        raise DatasetError(f"{spec_path}: size must be [height, width], two positive integers")
    if mode not in CHANNELS:
        raise DatasetError(f"{spec_path}: mode must be one of {sorted(CHANNELS)}, got {mode!r}")
    fields = own.common(spec_path, raw, strings=True)
    return ImageSpec(**fields, size=(size[0], size[1]), mode=mode)


def _files(spec: ImageSpec) -> list[tuple[Path, str]]:
    """Every file under the folder with its class, refusing a stray file or sub-folder, a
    missing class folder, an empty folder and images of one class only."""
    root = spec.path
    if not root.is_dir():
        raise DatasetError(f"image folder not found: {root} (named by {spec.spec_path})")
    for entry in sorted(root.iterdir()):
        if not entry.is_dir() or entry.name not in spec.classes:
            raise DatasetError(
                f"{entry}: not a declared class sub-folder (classes: {list(spec.classes)})"
            )
    files = []
    for name in spec.classes:
        folder = root / name
        if not folder.is_dir():
            raise DatasetError(f"{root}: missing class sub-folder {name!r}")
        for path in sorted(folder.iterdir()):
            if not path.is_file():
                raise DatasetError(f"{path}: a class sub-folder holds image files only")
            files.append((path, name))
    if not files:
        raise DatasetError(f"{root}: no images")
    held = sorted({name for _, name in files})
    if len(held) < 2:
        raise DatasetError(
            f"{root}: only the class sub-folder {held[0]!r} holds images; a classifier needs two"
        )
    return files


def _pixels(spec: ImageSpec, path: Path) -> np.ndarray:
    """The image at ``path`` as (C, H, W) uint8, refused unless it decodes at the declared
    size and mode."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            mode, width, height = image.mode, image.width, image.height
            pixels = np.asarray(image)
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as error:
        raise DatasetError(f"{path}: the image does not decode ({type(error).__name__})") from None
    if mode != spec.mode or (height, width) != spec.size:
        raise DatasetError(
            f"{path}: a {mode} image of {height}x{width}, but the spec declares {spec.mode} "
            f"{spec.size[0]}x{spec.size[1]}"
        )
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def load_images(spec_path: str | Path, limit: int | None = None) -> DatasetSplits:
    """The image folder of the spec at ``spec_path`` (its first ``limit`` files, by class then
    name) in keyed splits; the fingerprint hashes every file's path and bytes."""
    spec = read_spec(spec_path)
    files = _files(spec)[:limit]
    pixels = np.stack([_pixels(spec, path) for path, _ in files])
    features = torch.from_numpy(pixels.astype(np.float32) / np.float32(255))
    labels = own.label_indices(f"{spec.path}: class", [name for _, name in files], spec.classes)
    units = [path.relative_to(spec.path).as_posix() for path, _ in files]
    content = own.files_digest(spec.path, [path for path, _ in files])
    return own.assemble(DatasetName.IMAGE_FOLDER, spec, features, labels, units, content, limit)
