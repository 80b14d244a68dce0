"""A transformers model from a local directory, fine-tuned on its declared parameter subset
(docs/design.md#fine-tuning). Imported only by the code paths that build such a model, so other
commands never load transformers or peft.

:func:`build_fine_tuned` reloads the base from its directory after checking the files' digest
against the one recorded, then freezes every parameter but the trained subset: LoRA adapters
(``peft``, its sequence-classification task, which also trains the classification head) or the
named layers. :class:`FineTuned` wraps the result for the trainer and evaluation: its input row
is the (2, L) stack of token ids and attention mask, and its state is the trained parameters
only, so a candidate's weights file, its checkpoints and a merge hold exactly what DP-SGD
trained, never the public base.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from peft import LoraConfig, TaskType, get_peft_model
from torch import nn
from transformers import AutoModelForSequenceClassification
from transformers.utils import logging as transformers_logging

from dpmerge.artifacts import ModelSpec
from dpmerge.errors import BaseModelError, RecordError
from dpmerge.fine_tuning import FineTune, base_digest
from dpmerge.formatting import cut

transformers_logging.disable_progress_bar()  # a command's stderr is its one line, not a bar


class FineTuned(nn.Module):
    """A sequence classifier whose state is its trained parameters (the base is public and is
    reloaded by digest)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.trained = tuple(name for name, p in self.named_parameters() if p.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x[:, 0], attention_mask=x[:, 1]).logits

    def state_dict(
        self, *, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        full = super().state_dict(prefix=prefix, keep_vars=keep_vars)
        kept = OrderedDict() if destination is None else destination
        for name in self.trained:
            kept[prefix + name] = full[prefix + name]
        return kept

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load the trained parameters; ``strict`` refuses any other key set."""
        missing = sorted(set(self.trained) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(self.trained))
        if strict and (missing or unexpected):
            raise RecordError(
                f"weights are not this fine-tune's trained parameters: {len(missing)} missing "
                f"(e.g. {missing[:1]}), {len(unexpected)} unexpected (e.g. {unexpected[:1]})"
            )
        return super().load_state_dict(state_dict, strict=False, assign=assign)


def _base(fine_tune: FineTune, num_classes: int) -> nn.Module:
    digest = base_digest(fine_tune.base_dir)
    if digest != fine_tune.base_digest:
        raise BaseModelError(
            f"base model {fine_tune.base_dir} has digest {digest}, but the record names "
            f"{fine_tune.base_digest}: not the base these weights were trained from"
        )
    try:
        model = AutoModelForSequenceClassification.from_pretrained(fine_tune.base_dir)
    except (OSError, ValueError) as error:
        raise BaseModelError(
            f"{fine_tune.base_dir} is not a transformers sequence classifier "
            f"({cut(str(error), 200)})"
        ) from None
    if model.config.num_labels != num_classes:
        raise BaseModelError(
            f"base model {fine_tune.base_dir} has {model.config.num_labels} labels, "
            f"the data {num_classes} classes"
        )
    return model


def _check_targets(model: nn.Module, targets: tuple[str, ...]) -> None:
    """Refuse a LoRA target that matches no module (as a name's last components, peft's rule)."""
    modules = [name for name, _ in model.named_modules()]
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in modules):
            raise BaseModelError(f"LoRA target {target!r} names no module of the base model")


def build_fine_tuned(spec: ModelSpec) -> FineTuned:
    """The fine-tuned module of ``spec``, in training mode (Opacus records activations only in
    training mode), its trained subset the only parameters that require gradients."""
    fine_tune = spec.fine_tune
    if fine_tune is None:
        raise RecordError(f"model {spec.name!r} needs its fine_tune (base and trained subset)")
    model = _base(fine_tune, spec.num_classes)
    if fine_tune.lora:
        _check_targets(model, fine_tune.lora_targets)
        config = LoraConfig(
            task_type=TaskType.SEQ_CLS,
            r=fine_tune.lora_rank,
            lora_alpha=fine_tune.lora_alpha,
            target_modules=list(fine_tune.lora_targets),
        )
        model = get_peft_model(model, config)
    else:
        trained = set()
        for layer in fine_tune.train_layers:
            owned = {n for n, _ in model.named_parameters() if f".{layer}." in f".{n}"}
            if not owned:
                raise BaseModelError(f"trained layer {layer!r} names no module with parameters")
            trained |= owned
        for name, parameter in model.named_parameters():
            parameter.requires_grad = name in trained
    module = FineTuned(model)
    _check_per_example(module, spec.input_shape)
    return module.train()


def _check_per_example(module: FineTuned, input_shape: tuple[int, ...]) -> None:
    """Refuse a trained module whose input is shared by the batch rather than one per example
    (a position embedding indexed by positions alone): its gradient cannot be split into
    per-example gradients, so DP-SGD could not clip them. One forward pass of two rows finds
    each trained module's input."""
    owners = {
        name: child
        for name, child in module.named_modules()
        if any(p.requires_grad for p in child.parameters(recurse=False))
    }
    shapes: dict[str, tuple[int, ...]] = {}

    def record(name: str) -> Any:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...], _output: Any) -> None:
            shapes.setdefault(name, tuple(args[0].shape))

        return hook

    hooks = [child.register_forward_hook(record(name)) for name, child in owners.items()]
    rows = torch.ones((2, *input_shape), dtype=torch.int64)
    try:
        with torch.no_grad():
            module.eval()(rows)
    finally:
        for hook in hooks:
            hook.remove()
    for name, shape in shapes.items():
        if not shape or shape[0] != len(rows):
            raise BaseModelError(
                f"trained module {name!r} takes an input shared by the batch (shape {shape} for "
                f"{len(rows)} rows): its per-example gradients do not exist; train other layers"
            )
