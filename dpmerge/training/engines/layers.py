"""Per-example gradients of the parameter layers from one batched backward pass (grad-sample
mode ``layers``; docs/design.md#mechanism-record: only how the gradients are computed differs,
so the mechanism and its record are the Opacus engine's).

One ordinary batched forward pass keeps each parameter layer's input and output; one batched
backward pass (``torch.autograd.grad`` of the summed per-example losses with respect to those
outputs, so no parameter ``.grad`` is computed) gives each example's gradient at each layer's
output. Each parameter's per-example gradient is then the layer's own closed form:

* ``Linear``: ``g_b aᵀ_b`` (bias ``g_b``);
* ``Conv2d``: the weight gradient of one convolution with the batch as its groups, whose group
  ``b`` maps example ``b``'s input to its output (bias ``g_b`` summed over positions);
* ``GroupNorm``: the affine gradients of one group norm with the batch as its channels
  (one example of B·C channels in B·G groups), whose channel ``(b, c)`` is example ``b``'s.

Layers without parameters (pooling, activations) run batched in both passes, unlike ``vmap``,
where ``torch.func`` batches max-pool's and GroupNorm's backward element by element
(docs/results.md §6.2). Opacus (its ``no_op`` mode) clips, sums and noises the ``grad_sample``
tensors set here, exactly as those of its other modes.
"""

from __future__ import annotations

import torch
from torch import nn

from dpmerge.training.config import TrainingConfigError

LAYERS = (nn.Linear, nn.Conv2d, nn.GroupNorm)
"""The layers whose per-example gradients this mode computes."""


class LayerGradients:
    """Sets ``p.grad_sample`` of ``module``'s parameters to per-example gradients of ``loss``
    (a mean over the batch, as Opacus' ``loss_reduction="mean"``)."""

    def __init__(self, module: nn.Module, loss: nn.Module) -> None:
        self.module, self.loss = module, loss
        self._reused: dict[nn.Module, torch.Tensor] = {}
        self.layers = [
            layer
            for layer in module.modules()
            if isinstance(layer, LAYERS) and list(layer.parameters(recurse=False))
        ]
        covered = {id(p) for layer in self.layers for p in layer.parameters(recurse=False)}
        if any(id(p) not in covered for p in module.parameters()):
            raise TrainingConfigError(
                "grad_sample_mode 'layers' supports models whose parameters are all in "
                "Linear, Conv2d and GroupNorm layers"
            )
        for layer in self.layers:
            if isinstance(layer, nn.Conv2d) and (
                layer.groups != 1 or layer.padding_mode != "zeros" or isinstance(layer.padding, str)
            ):
                raise TrainingConfigError(
                    "grad_sample_mode 'layers' supports Conv2d with groups 1 and zero padding"
                )

    def compute(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Set each parameter's ``grad_sample`` (leading dimension ``len(y)``); the batch's
        mean loss (NaN for an empty batch, which gets empty per-example gradients)."""
        if len(y) == 0:
            for p in self.module.parameters():
                p.grad_sample = p.new_zeros((0, *p.shape))
            return torch.tensor(float("nan"))
        inputs: dict[nn.Module, torch.Tensor] = {}
        outputs: dict[nn.Module, torch.Tensor] = {}
        moments: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(layer: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if layer in outputs:
                raise TrainingConfigError(
                    "grad_sample_mode 'layers' supports models that call each layer once"
                )
            inputs[layer], outputs[layer] = args[0].detach(), out
            saved = out.grad_fn  # a group norm's moments, read before the backward frees them
            if type(saved).__name__ == "NativeGroupNormBackward0":
                moments[layer] = (saved._saved_result1, saved._saved_result2)

        handles = [layer.register_forward_hook(keep) for layer in self.layers]
        try:
            mean = self.loss(self.module(x), y)
        finally:
            for handle in handles:
                handle.remove()
        # Σ_b loss_b: each example's gradient at a layer's output is its own loss's gradient.
        backprops = torch.autograd.grad(mean * len(y), [outputs[layer] for layer in self.layers])
        for layer, g in zip(self.layers, backprops, strict=True):
            a, g = inputs[layer], g.detach()
            _per_example(layer, a, g, moments.get(layer), self._outer_products(layer, a, g))
        return mean.detach()

    def _outer_products(
        self, layer: nn.Module, a: torch.Tensor, g: torch.Tensor
    ) -> torch.Tensor | None:
        """Where a ``Linear`` layer's per-example weight gradients go: the same memory every
        step for a layer on vectors (its B × out × in floats are the largest a step writes, and
        fresh memory each step costs page faults, docs/results.md §6.2), none for others. Each
        step's tensors are read (clipped and summed by Opacus) before the next step writes."""
        if not isinstance(layer, nn.Linear) or g.dim() != 2:
            return None
        buffer = self._reused.get(layer)
        if (
            buffer is None
            or len(buffer) < len(g)
            or (buffer.device, buffer.dtype) != (g.device, g.dtype)
        ):
            shape = (len(g) + len(g) // 8, g.shape[1], a.shape[1])  # room for the Poisson batch
            buffer = self._reused[layer] = g.new_empty(shape)
        return buffer[: len(g)]


def _per_example(
    layer: nn.Module,
    a: torch.Tensor,
    g: torch.Tensor,
    moments: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> None:
    """Set ``grad_sample`` of ``layer``'s parameters from its input ``a`` and the per-example
    gradients ``g`` at its output; for a ``GroupNorm``, ``moments`` are the mean and reciprocal
    standard deviation of each example's groups as its forward pass computed them (autograd's
    documented ``_saved_`` attributes of ``NativeGroupNormBackward0``), computed again if
    ``None``; ``out``, if given, receives a ``Linear`` layer's per-example weight gradients."""
    if isinstance(layer, nn.Linear) and out is not None:
        weight = torch.mul(g[:, :, None], a[:, None, :], out=out)
        bias = g
    elif isinstance(layer, nn.Linear):
        weight = torch.einsum("b...o,b...i->boi", g, a)
        bias = g.flatten(1, -2).sum(1) if g.dim() > 2 else g
    elif isinstance(layer, nn.Conv2d):
        # The batch as groups: example b's input channels feed only its own output channels, so
        # this grouped convolution's weight gradient holds each example's weight gradient.
        n, shape = len(a), layer.weight.shape
        weight = torch.nn.grad.conv2d_weight(
            a.reshape(1, n * a.shape[1], *a.shape[2:]),
            (n * shape[0], *shape[1:]),
            g.reshape(1, n * g.shape[1], *g.shape[2:]),
            layer.stride,
            layer.padding,
            layer.dilation,
            groups=n,
        ).view(n, *shape)
        bias = g.sum((2, 3))
    else:
        # The batch as channels: one example of B·C channels in B·G groups is normalised over
        # exactly the batch's groups, and its per-channel affine gradients are each example's.
        n, channels, groups = len(a), a.shape[1], len(a) * layer.num_groups
        flat = a.reshape(1, n * channels, -1)
        size = (1, n * channels, flat.shape[2], groups)
        if moments is None:
            _, mean, rstd = torch.native_group_norm(flat, None, None, *size, layer.eps)
        else:
            mean, rstd = (m.reshape(1, groups) for m in moments)
        _, weight, bias = torch.ops.aten.native_group_norm_backward(
            g.reshape(flat.shape),
            flat,
            mean,
            rstd,
            layer.weight.detach().repeat(n),
            *size,
            [False, True, True],
        )
        weight, bias = weight.view(n, channels), bias.view(n, channels)
    layer.weight.grad_sample = weight
    if layer.bias is not None:
        layer.bias.grad_sample = bias
