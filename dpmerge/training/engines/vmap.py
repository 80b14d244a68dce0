"""Per-example gradients by ``torch.func``: ``vmap(grad_and_value(loss of one example))``
over the batch (docs/design.md#mechanism-record: only how the gradients are computed differs,
so the mechanism and its record are the Opacus engine's).

The Opacus engine runs this in grad-sample mode ``vmap``: Opacus wraps the module without hooks
(its ``no_op`` mode) and its ``DPOptimizer`` clips, sums and noises the ``grad_sample`` tensors
set here, exactly as it does those its hooks compute. One forward and one backward pass, both
batched by ``vmap``; no parameter ``.grad`` is computed beside the per-example gradients.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap


class PerExampleGradients:
    """Sets ``p.grad_sample`` of ``module``'s parameters to per-example gradients of ``loss``."""

    def __init__(self, module: nn.Module, loss: nn.Module) -> None:
        self.parameters = dict(module.named_parameters())

        def one(parameters: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
            return loss(functional_call(module, parameters, (x.unsqueeze(0),)), y.unsqueeze(0))

        self._batched = vmap(grad_and_value(one), in_dims=(None, 0, 0))

    def compute(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Set each parameter's ``grad_sample`` (leading dimension ``len(y)``); the batch's
        mean loss (NaN for an empty batch, which gets empty per-example gradients)."""
        if len(y) == 0:
            for p in self.parameters.values():
                p.grad_sample = p.new_zeros((0, *p.shape))
            return torch.tensor(float("nan"))
        detached = {name: p.detach() for name, p in self.parameters.items()}
        grads, losses = self._batched(detached, x, y)
        for name, p in self.parameters.items():
            p.grad_sample = grads[name]
        return losses.mean().detach()
