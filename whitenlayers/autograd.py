"""Custom autograd Functions of the whitening layers.

They treat the whitening quantities (``T``, ``mu``, ``Q_s``) as constants: no gradient flows to them, and they are
held by reference on ``ctx`` (the layers hand in tensors that are never written afterwards, so the backward uses
exactly the transform that was in force during the forward).

Each Function is two classes with the same forward and backward:

* the one a training step takes (``forward(ctx, ...)``): ``Function.apply`` calls it as it is, where a Function with
  ``setup_context`` has its arguments bound with ``inspect`` at every call (about 20 us on a CPU, more than the rest
  of a layer's step: ``benchmarks/RESULTS.md``);
* its :mod:`torch.func` form (the public class: ``forward`` without ``ctx``, ``setup_context``,
  ``generate_vmap_rule = True`` and a ``jvp`` rule, the forward being linear in its differentiable input), which the
  transforms (``vmap``, ``grad``, ``vjp``, ``jacrev``, ``jacfwd``, per-sample gradients ``vmap(grad(...))``) need, and
  which the functions below take inside one (:func:`~whitenlayers._torch_compat.transforms_active`).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import einops
import torch
import torch.nn.functional as F
from torch import Tensor

from ._torch_compat import compiling, function_apply, transforms_active
from .functional import transform_weight_grad

__all__ = ["DirectWhitenFunction", "WeightGradTransform", "PointwiseWhitenFunction", "direct_whiten",
           "grad_transformed", "pointwise_whiten", "transformed_weight"]


def _channels_last(x: Tensor) -> bool:
    """Whether the 4-D ``x`` is channels_last and not contiguous (a ``(B, H, W, M)`` view). ``False`` inside
    ``torch.vmap``, which cannot say (it answers the memory-format question with an error): the layout-free path
    then runs."""
    if x.is_contiguous():
        return False
    try:
        return x.is_contiguous(memory_format=torch.channels_last)
    except RuntimeError:  # a batched tensor: "NYI: querying is_contiguous inside of vmap for memory_format ..."
        return False


def _feature_matmul(mat: Tensor, x: Tensor) -> Tensor:
    """``out[:, i, ...] = sum_j mat[i, j] x[:, j, ...]`` for ``x`` of shape ``(B, M, *)``.

    ``mat`` may be a block-diagonal ``(G, k, k)`` stack (grouped whitening): group ``g``'s features times ``mat[g]``.
    """
    mat = mat.to(x.dtype)
    if x.numel() == 0:
        return torch.empty_like(x)  # keeps the memory format, which the paths below lose for an empty batch
    if mat.dim() == 3:
        g, k = mat.shape[0], mat.shape[-1]
        if k == 1:  # depthwise: a scale per channel, in x's own layout
            return x * mat.reshape((1, g) + (1,) * (x.dim() - 2))
        if x.dim() == 4 and _channels_last(x):  # each position's group rows times mat[g]^T, kept channels_last
            rows = einops.rearrange(x, "b (g k) h w -> b h w g 1 k", g=g)  # a view of the (B, H, W, M) memory
            out = rows @ mat.transpose(-1, -2)
            return einops.rearrange(out, "b h w g 1 k -> b (g k) h w")
        per_group = einops.rearrange(x, "b (g k) ... -> b g k (...)", g=g)  # (B, G, k, positions)
        return torch.matmul(mat, per_group).reshape(x.shape)
    if x.dim() == 2:
        return x @ mat.t()
    if x.dim() == 4 and _channels_last(x):  # the (B, H, W, M) rows times mat^T: one product, kept channels_last
        return (x.permute(0, 2, 3, 1) @ mat.t()).permute(0, 3, 1, 2)
    return torch.matmul(mat, x.flatten(2)).reshape(x.shape)  # flatten(2): also valid for an empty batch


def _transform_mean(transform: Tensor, mean: Tensor) -> Tensor:
    """``T mu`` for a dense or a block-diagonal ``(G, k, k)`` ``T``."""
    if transform.dim() == 3:
        return (transform @ mean.view(transform.shape[0], -1, 1)).reshape(-1)
    return transform @ mean


def _direct_forward(x: Tensor, transform: Tensor, mean: Tensor) -> Tensor:
    """``T x - T mu`` on dim 1."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    offset = _transform_mean(transform, mean).to(x.dtype).view(shape)
    return _feature_matmul(transform, x).sub_(offset)  # in place: the product is a fresh tensor


def _pointwise(x: Tensor, weight: Tensor, bias: Optional[Tensor], groups: int) -> Tensor:
    """``out[:, i] = sum_j weight[i, j] x[:, j] + bias[i]`` on dim 1 (``weight`` ``(M, M/groups)``, block-diagonal
    per group): one op in ``x``'s layout: a matrix product (``addmm``) on the rows of a dense ``(B, M)`` or
    channels_last input, else a 1x1 convolution. (The product: the same GEMM, with less host time per call than
    a convolution: 10 against 25 us on the CPU for ResNet-50's small layers, ``benchmarks/RESULTS.md``.)"""
    nd = x.dim() - 2
    if nd == 0 and groups == 1:
        return x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())
    if nd == 0:
        return _pointwise(x.unsqueeze(-1), weight, bias, groups).squeeze(-1)
    if nd == 2 and groups == 1 and x.numel() > 0 and _channels_last(x):
        rows = x.permute(0, 2, 3, 1)  # (B, H, W, M), contiguous
        flat = rows.reshape(-1, rows.shape[-1])
        out = flat @ weight.t() if bias is None else torch.addmm(bias, flat, weight.t())
        return out.view(rows.shape[:3] + (weight.shape[0],)).permute(0, 3, 1, 2)  # channels_last
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    return conv(x, weight.view(weight.shape + (1,) * nd), bias, groups=groups)


class _DirectWhiten(torch.autograd.Function):
    """:class:`DirectWhitenFunction` as a training step calls it (no ``setup_context``: see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, transform: Tensor, mean: Tensor) -> Tensor:
        ctx.transform = transform
        return _direct_forward(x, transform, mean)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Tuple[Optional[Tensor], None, None]:
        grad_in = None
        if ctx.needs_input_grad[0]:
            grad_in = _feature_matmul(ctx.transform.mT, grad_out)
        return grad_in, None, None


class DirectWhitenFunction(torch.autograd.Function):
    """``y = T (x - mu)`` on dim 1; backward ``dx = T^T dy``. Saves no activation. The :mod:`torch.func` form."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, transform: Tensor, mean: Tensor) -> Tensor:
        return _direct_forward(x, transform, mean)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
        ctx.transform = inputs[1]

    backward = _DirectWhiten.backward

    @staticmethod
    def jvp(ctx: Any, x_t: Optional[Tensor], *_: Any) -> Optional[Tensor]:
        return None if x_t is None else _feature_matmul(ctx.transform, x_t)  # linear in x (T, mu constant)


class _WeightGradTransform(torch.autograd.Function):
    """:class:`WeightGradTransform` as a training step calls it (no ``setup_context``)."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, q: Tensor) -> Tensor:
        ctx.q = q
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        return transform_weight_grad(grad, ctx.q), None


class WeightGradTransform(torch.autograd.Function):
    """Identity on the weight in the forward; right-multiplies its gradient by ``Q`` in the backward. The
    :mod:`torch.func` form: its ``jvp`` is the adjoint of its backward (``t -> t Q^T``), so that forward and reverse
    mode agree (``jacfwd == jacrev``, forward-over-reverse Hessian products)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(weight: Tensor, q: Tensor) -> Tensor:
        return weight.view_as(weight)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Tensor, Tensor], output: Tensor) -> None:
        ctx.q = inputs[1]

    backward = _WeightGradTransform.backward

    @staticmethod
    def jvp(ctx: Any, weight_t: Optional[Tensor], _: Any) -> Optional[Tensor]:
        return None if weight_t is None else transform_weight_grad(weight_t, ctx.q.mT)


class _PointwiseWhiten(torch.autograd.Function):
    """:class:`PointwiseWhitenFunction` as a training step calls it (no ``setup_context``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, weight_t: Tensor, groups: int) -> Tensor:
        ctx.weight_t, ctx.groups = weight_t, groups
        return _pointwise(x, weight.to(x.dtype), bias.to(x.dtype), groups)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Tuple[Optional[Tensor], None, None, None, None]:
        grad_in = None
        if ctx.needs_input_grad[0]:
            grad_in = _pointwise(grad_out, ctx.weight_t.to(grad_out.dtype), None, ctx.groups)
        return grad_in, None, None, None, None


class PointwiseWhitenFunction(torch.autograd.Function):
    """``y = T x - T mu`` on dim 1 as one 1x1 convolution, backward ``dx = T^T dy`` as another; the layer hands in
    ``T``, ``-T mu`` and ``T^T`` (prepared once per block). Saves no activation. The :mod:`torch.func` form."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weight: Tensor, bias: Tensor, weight_t: Tensor, groups: int) -> Tensor:
        return _pointwise(x, weight.to(x.dtype), bias.to(x.dtype), groups)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Tensor, Tensor, Tensor, Tensor, int], output: Tensor) -> None:
        ctx.weight, ctx.weight_t, ctx.groups = inputs[1], inputs[3], inputs[4]

    backward = _PointwiseWhiten.backward

    @staticmethod
    def jvp(ctx: Any, x_t: Optional[Tensor], *_: Any) -> Optional[Tensor]:
        # linear in x (T, -T mu constant)
        return None if x_t is None else _pointwise(x_t, ctx.weight.to(x_t.dtype), None, ctx.groups)


class _TransformedWeight(torch.autograd.Function):
    """``W T`` on the input-feature axis (a fused ``DirectWhitenWrapper``'s weight, :func:`transformed_weight`);
    backward ``dW = d(W T) T^T``, in the gradient's own strides (autograd's backward of the product gives a 1x1
    channels_last weight contiguous ones, which DDP's buckets take only through a copy and a warning)."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, transform: Tensor) -> Tensor:
        ctx.transform = transform
        return transform_weight_grad(weight, transform)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        return transform_weight_grad(grad, ctx.transform.mT), None


#: Input ranks the 1x1-convolution path of DirectWhiten takes: (B, M) and 1-D, 2-D, 3-D feature maps.
POINTWISE_DIMS = (2, 3, 4, 5)
#: The training step's calls of the Functions (outside the torch.func transforms: :func:`~whitenlayers._torch_compat.
#: function_apply`).
direct_whiten_apply = function_apply(_DirectWhiten)
grad_transformed_apply = function_apply(_WeightGradTransform)
pointwise_whiten_apply = function_apply(_PointwiseWhiten)
transformed_weight_apply = function_apply(_TransformedWeight)


def direct_whiten(x: Tensor, transform: Tensor, mean: Tensor) -> Tensor:
    """``T (x - mu)`` on dim 1 through :class:`DirectWhitenFunction` (``T``, ``mu`` constant)."""
    if compiling():  # (dynamo traces Function.apply)
        return _DirectWhiten.apply(x, transform, mean)
    if transforms_active():
        return DirectWhitenFunction.apply(x, transform, mean)
    return direct_whiten_apply(x, transform, mean)


def grad_transformed(weight: Tensor, q: Tensor) -> Tensor:
    """``weight``, whose gradient will be right-multiplied by ``q`` on the input-feature axis (WeightGradTransform)."""
    if compiling():
        return _WeightGradTransform.apply(weight, q)
    if transforms_active():
        return WeightGradTransform.apply(weight, q)
    return grad_transformed_apply(weight, q)


def pointwise_whiten(x: Tensor, weight: Tensor, bias: Tensor, weight_t: Tensor, groups: int) -> Tensor:
    """:class:`PointwiseWhitenFunction` (``weight = T``, ``bias = -T mu``, ``weight_t = T^T``)."""
    if compiling():
        return _PointwiseWhiten.apply(x, weight, bias, weight_t, groups)
    if transforms_active():
        return PointwiseWhitenFunction.apply(x, weight, bias, weight_t, groups)
    return pointwise_whiten_apply(x, weight, bias, weight_t, groups)


def transformed_weight(weight: Tensor, transform: Tensor) -> Tensor:
    """``W T`` on the input-feature axis (``T`` constant), with ``W``'s gradient in its own strides; inside a
    torch.func transform the product's own differentiable operations."""
    if compiling():
        return _TransformedWeight.apply(weight, transform)
    if transforms_active():
        return transform_weight_grad(weight, transform)
    return transformed_weight_apply(weight, transform)
