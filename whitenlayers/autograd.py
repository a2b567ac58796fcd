"""Custom autograd Functions of the whitening layers.

They treat the whitening quantities (``T``, ``mu``, ``Q_s``) as constants: no
gradient flows to them, and they are held by reference on ``ctx`` (the layers
hand in a tensor that is never modified in place afterwards, so the backward
uses exactly the transform that was in force during the forward).

Each has a ``forward`` without ``ctx`` and a ``setup_context``, and
``generate_vmap_rule = True`` (their forward and backward are PyTorch operations
only, each valid on a batched tensor), so the :mod:`torch.func` transforms
(``vmap``, ``grad``, ``vjp``, ``jacrev``, per-sample gradients
``vmap(grad(...))``) run through them. Under those transforms the layers use
subclasses with a ``jvp`` rule (the forward is linear in its differentiable
input), for ``jvp`` / ``jacfwd``: Dynamo cannot trace a Function that has one.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .functional import transform_weight_grad

_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)

__all__ = ["DirectWhitenFunction", "WeightGradTransform", "PointwiseWhitenFunction", "direct_whiten",
           "grad_transformed", "pointwise_whiten"]


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
        if x.dim() == 4 and _channels_last(x):
            xl = x.permute(0, 2, 3, 1)  # (B, H, W, M), contiguous
            out = (xl.reshape(xl.shape[:3] + (g, 1, k)) @ mat.transpose(-1, -2)).reshape(xl.shape)
            return out.permute(0, 3, 1, 2)
        return torch.matmul(mat, x.reshape(x.shape[0], g, k, -1)).reshape(x.shape)  # (B, G, k, P)
    if x.dim() == 2:
        return x @ mat.t()
    if x.dim() == 4 and _channels_last(x):
        # (B, H, W, M) view: one matrix product, result kept channels_last.
        return (x.permute(0, 2, 3, 1) @ mat.t()).permute(0, 3, 1, 2)
    return torch.matmul(mat, x.flatten(2)).reshape(x.shape)  # flatten(2): also valid for an empty batch


def _transform_mean(transform: Tensor, mean: Tensor) -> Tensor:
    """``T mu`` for a dense or a block-diagonal ``(G, k, k)`` ``T``."""
    if transform.dim() == 3:
        return (transform @ mean.view(transform.shape[0], -1, 1)).reshape(-1)
    return transform @ mean


class DirectWhitenFunction(torch.autograd.Function):
    """``y = T (x - mu)`` on dim 1; backward ``dx = T^T dy``. Saves no activation."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, transform: Tensor, mean: Tensor) -> Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        offset = _transform_mean(transform, mean).to(x.dtype).view(shape)
        return _feature_matmul(transform, x).sub_(offset)  # in place: the product is a fresh tensor

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
        ctx.transform = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Tuple[Optional[Tensor], None, None]:
        grad_in = None
        if ctx.needs_input_grad[0]:
            grad_in = _feature_matmul(ctx.transform.mT, grad_out)
        return grad_in, None, None


class WeightGradTransform(torch.autograd.Function):
    """Identity on the weight in the forward; right-multiplies its gradient by ``Q`` in the backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(weight: Tensor, q: Tensor) -> Tensor:
        return weight.view_as(weight)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Tensor, Tensor], output: Tensor) -> None:
        ctx.q = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        return transform_weight_grad(grad, ctx.q), None


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


class PointwiseWhitenFunction(torch.autograd.Function):
    """``y = T x - T mu`` on dim 1 as one 1x1 convolution, backward ``dx = T^T dy`` as another; the layer hands in
    ``T``, ``-T mu`` and ``T^T`` (prepared once per block). Saves no activation."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weight: Tensor, bias: Tensor, weight_t: Tensor, groups: int) -> Tensor:
        return _pointwise(x, weight.to(x.dtype), bias.to(x.dtype), groups)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Tensor, Tensor, Tensor, Tensor, int], output: Tensor) -> None:
        ctx.weight_t, ctx.groups = inputs[3], inputs[4]

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Tuple[Optional[Tensor], None, None, None, None]:
        grad_in = None
        if ctx.needs_input_grad[0]:
            grad_in = _pointwise(grad_out, ctx.weight_t.to(grad_out.dtype), None, ctx.groups)
        return grad_in, None, None, None, None


#: Input ranks the 1x1-convolution path of DirectWhiten takes: (B, M) and 1-D, 2-D, 3-D feature maps.
POINTWISE_DIMS = (2, 3, 4, 5)

# ``Function.apply`` of a Function with ``setup_context`` binds its arguments to ``forward``'s signature with
# ``inspect`` at every call (about 17 us on a CPU, more than the rest of a layer's step); outside the torch.func
# transforms it then ends in the C++ apply, which the functions below call directly with the same arguments (all
# positional, no defaults to bind), after the one other thing ``Function.apply`` does there (a tensor left over from
# a finished transform unwrapped). Under a transform, and for torch.compile (which traces ``Function.apply``):
# ``Function.apply`` itself.
#: Whether a torch.func transform (vmap, grad, jacrev, ...) is active: one C call.
_transforms_active: Callable[[], bool] = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_unwrap_if_dead: Any = getattr(torch._C._functorch, "unwrap_if_dead", None)


def _fast_apply(fn: Any) -> Any:
    """The C++ apply of ``fn`` (``None``: ``Function.apply``, where this torch lacks what the shortcut needs)."""
    if not hasattr(torch._C, "_are_functorch_transforms_active") or _unwrap_if_dead is None:
        return None
    return super(torch.autograd.Function, fn).apply


class _DirectWhitenFunc(DirectWhitenFunction):
    """:class:`DirectWhitenFunction` with a ``jvp`` rule, for the torch.func transforms."""

    @staticmethod
    def jvp(ctx: Any, x_t: Optional[Tensor], *_: Any) -> Optional[Tensor]:
        return None if x_t is None else _feature_matmul(ctx.transform, x_t)  # linear in x (T, mu constant)


class _WeightGradTransformFunc(WeightGradTransform):
    """:class:`WeightGradTransform` with a ``jvp`` rule, for the torch.func transforms: the adjoint of its backward
    (``t -> t Q^T``), so that forward and reverse mode agree (``jacfwd == jacrev``, forward-over-reverse Hessian
    products): the layer's derivative with respect to its weight is the transformed one in either mode."""

    @staticmethod
    def jvp(ctx: Any, weight_t: Optional[Tensor], _: Any) -> Optional[Tensor]:
        return None if weight_t is None else transform_weight_grad(weight_t, ctx.q.mT)


class _PointwiseWhitenFunc(PointwiseWhitenFunction):
    """:class:`PointwiseWhitenFunction` with a ``jvp`` rule, for the torch.func transforms."""

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Tensor, Tensor, Tensor, Tensor, int], output: Tensor) -> None:
        ctx.weight, ctx.weight_t, ctx.groups = inputs[1], inputs[3], inputs[4]

    @staticmethod
    def jvp(ctx: Any, x_t: Optional[Tensor], *_: Any) -> Optional[Tensor]:
        # linear in x (T, -T mu constant)
        return None if x_t is None else _pointwise(x_t, ctx.weight.to(x_t.dtype), None, ctx.groups)


_direct_apply = _fast_apply(DirectWhitenFunction)
_weight_grad_apply = _fast_apply(WeightGradTransform)
_pointwise_apply = _fast_apply(PointwiseWhitenFunction)


def direct_whiten(x: Tensor, transform: Tensor, mean: Tensor) -> Tensor:
    """Functional form of :class:`DirectWhitenFunction` (``T``, ``mu`` constant)."""
    if _direct_apply is None or _is_compiling():
        return DirectWhitenFunction.apply(x, transform, mean)
    if _transforms_active():
        return _DirectWhitenFunc.apply(x, transform, mean)
    return _direct_apply(_unwrap_if_dead(x), _unwrap_if_dead(transform), _unwrap_if_dead(mean))


def grad_transformed(weight: Tensor, q: Tensor) -> Tensor:
    """``weight`` whose gradient will be right-multiplied by ``q`` (input-feature axis)."""
    if _weight_grad_apply is None or _is_compiling():
        return WeightGradTransform.apply(weight, q)
    if _transforms_active():
        return _WeightGradTransformFunc.apply(weight, q)
    return _weight_grad_apply(_unwrap_if_dead(weight), _unwrap_if_dead(q))


def pointwise_whiten(x: Tensor, weight: Tensor, bias: Tensor, weight_t: Tensor, groups: int) -> Tensor:
    """Functional form of :class:`PointwiseWhitenFunction` (``weight = T``, ``bias = -T mu``, ``weight_t = T^T``)."""
    if _pointwise_apply is None or _is_compiling():
        return PointwiseWhitenFunction.apply(x, weight, bias, weight_t, groups)
    if _transforms_active():
        return _PointwiseWhitenFunc.apply(x, weight, bias, weight_t, groups)
    return _pointwise_apply(_unwrap_if_dead(x), _unwrap_if_dead(weight), _unwrap_if_dead(bias),
                            _unwrap_if_dead(weight_t), groups)
