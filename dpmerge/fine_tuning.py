"""What a fine-tuned transformer declares: its base by digest and the parameters DP-SGD trains
(docs/design.md#fine-tuning). No torch or transformers here: ``dpmerge train`` checks these
options before either loads.

The base is a local directory of a transformers model (``save_pretrained``), public and frozen;
its digest is SHA-256 over its files' relative paths and contents, so a copy elsewhere has the
same digest and a changed file another. The trained subset is either LoRA adapters (rank,
scaling α, the module names they adapt) or named layers (module-name prefixes), never both.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpmerge.errors import BaseModelError, RecordError


@dataclass(frozen=True)
class FineTune:
    """A fine-tuned model's base and trained subset. Equality ignores ``base_dir`` (where this
    machine finds the base): two candidates of one base compare equal wherever it lies."""

    base_dir: str = field(compare=False)
    base_digest: str
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_targets: tuple[str, ...] = ()
    train_layers: tuple[str, ...] = ()

    @property
    def lora(self) -> bool:
        return self.lora_rank is not None

    def to_dict(self) -> dict[str, Any]:
        if self.lora:
            subset = {
                "lora_rank": self.lora_rank,
                "lora_alpha": self.lora_alpha,
                "lora_targets": list(self.lora_targets),
            }
        else:
            subset = {"train_layers": list(self.train_layers)}
        return {"base_dir": self.base_dir, "base_digest": self.base_digest, **subset}

    @classmethod
    def from_dict(cls, data: Any) -> FineTune:
        try:
            lora = data.get("lora_rank") is not None
            return cls(
                base_dir=str(data["base_dir"]),
                base_digest=str(data["base_digest"]),
                lora_rank=int(data["lora_rank"]) if lora else None,
                lora_alpha=float(data["lora_alpha"]) if lora else None,
                lora_targets=tuple(str(t) for t in data["lora_targets"]) if lora else (),
                train_layers=() if lora else tuple(str(t) for t in data["train_layers"]),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise RecordError(f"malformed fine_tune in model.json ({error!r})") from None


def base_digest(directory: str | Path) -> str:
    """``sha256:<hex>`` over the relative paths and contents of every file under
    ``directory``, in sorted order (a missing or empty directory is refused)."""
    root = Path(directory)
    if not root.is_dir():
        raise BaseModelError(f"base model directory not found: {root}")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if not files:
        raise BaseModelError(f"base model directory {root} holds no files")
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as handle:
            content = hashlib.file_digest(handle, "sha256").digest()
        digest.update(file.relative_to(root).as_posix().encode() + b"\0" + content)
    return f"sha256:{digest.hexdigest()}"


def names(text: str | None) -> tuple[str, ...]:
    """Comma-separated module names, each non-empty and distinct."""
    items = tuple(item.strip() for item in (text or "").split(","))
    if not all(items) or len(set(items)) < len(items):
        raise BaseModelError(f"module names must be distinct and comma-separated, got {text!r}")
    return items


def declared_fine_tune(
    model_dir: str,
    *,
    lora_rank: int | None,
    lora_alpha: float | None,
    lora_targets: str | None,
    train_layers: str | None,
) -> FineTune:
    """The fine-tune a run declares, the base's digest read off its directory now (recorded
    by its absolute path, wherever the command ran)."""
    digest = base_digest(model_dir)
    model_dir = str(Path(model_dir).resolve())
    if lora_rank is not None:
        return FineTune(
            model_dir,
            digest,
            lora_rank=lora_rank,
            lora_alpha=float(lora_alpha if lora_alpha is not None else lora_rank),
            lora_targets=names(lora_targets),
        )
    return FineTune(model_dir, digest, train_layers=names(train_layers))
