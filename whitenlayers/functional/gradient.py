"""The weight side: the centring offset ``sum_k W_k mu`` and the gradient transform ``dW <- dW Q_s``, dense
and grouped. Part of :mod:`whitenlayers.functional`."""
from __future__ import annotations

import torch
from torch import Tensor


def weight_mean_product(weight: Tensor, mean: Tensor) -> Tensor:
    """``sum_k W_k mean`` per output feature: kernel taps and input features summed.

    ``weight`` is ``(S, M)`` or ``(S, M, *kernel)``, ``mean`` ``(M,)``. It is the
    centring offset of a layer that centres on ``mean``, and, applied to a change
    of the mean, the bias compensation of eq. ``vtb_corr`` (ERRATA 8).

    A grouped convolution's weight ``(S, M/G, *kernel)`` (fewer input features
    than ``mean`` has) is read group by group: the ``S/G`` outputs of group
    ``g`` see its ``M/G`` features of ``mean``.

    Args:
        weight: the layer's weight ``(S, M)`` or ``(S, M, *kernel)`` (grouped: ``(S, M/G, *kernel)``).
        mean: a mean (or a change of the mean) of the ``M`` input features, ``(M,)``.

    Returns:
        ``(S,)`` in the promoted dtype of the two.
    """
    w = weight if weight.dim() == 2 else weight.reshape(weight.shape[0], weight.shape[1], -1).sum(-1)
    if w.shape[1] != mean.shape[0]:  # grouped convolution
        s, k = w.shape
        g = mean.shape[0] // k
        return (w.view(g, s // g, k) @ mean.to(w.dtype).view(g, k, 1)).reshape(s)
    return w @ mean.to(w.dtype)


# --------------------------------------------------------------------------
# Gradient transform
# --------------------------------------------------------------------------
#: On a CPU a kernel's weight gradient is transformed by one batched product up to this many input features, by
#: one transposed product above (2-core Xeon, 3x3 kernels, min of 3 rounds: batched/transposed 0.63x at 16, 0.57x
#: at 32, 0.85x at 64, 1.18x at 128, 1.44x at 256 features). On a GPU always the batched product (one kernel).
_CPU_BMM_MAX_FEATURES = 64


def transform_weight_grad(grad: Tensor, q: Tensor) -> Tensor:
    """Right-multiply a weight gradient by ``Q`` on the input-feature axis (dim 1).

    ``grad`` is ``(S, M)`` (linear) or ``(S, M, *kernel)`` (convolution, one
    ``S x M`` matrix per kernel tap): ``out[s, j, k] = sum_i grad[s, i, k] Q[i, j]``.
    A grouped ``Q`` ``(G, k, k)`` goes with a grouped convolution's gradient
    ``(S, k, *kernel)``: the ``S/G`` output channels of group ``g`` are
    right-multiplied by ``Q_g`` (``_grouped_weight_grad``).

    Args:
        grad: the weight gradient, ``(S, M)`` or ``(S, M, *kernel)`` (grouped: ``(S, k, *kernel)``).
        q: the gradient transform ``Q_s``, ``(M, M)``, or its diagonal blocks ``(G, k, k)``.

    Returns:
        The transformed gradient, ``grad``'s shape and dtype.
    """
    if q.dim() == 3:
        return _grouped_weight_grad(grad, q)
    if q.dtype != grad.dtype:
        q = q.to(grad.dtype)
    if grad.dim() == 2:
        return grad @ q
    # The common cases first, each a few Python-level calls: this runs in every layer's backward on every step.
    s, m = grad.shape[0], grad.shape[1]
    if grad.is_contiguous():
        if grad.numel() == s * m:  # a 1x1 kernel: one (S x M) @ (M x M) product
            return (grad.view(s, m) @ q).view(grad.shape)
        if grad.device.type != "cpu" or m <= _CPU_BMM_MAX_FEATURES:
            # One batched product, Q^T @ grad[s] for each output feature s (Q^T broadcast, not copied): one
            # kernel, the result in the gradient's own layout.
            return torch.bmm(q.t().expand(s, m, m), grad.view(s, m, -1)).view(grad.shape)
    else:
        rows = grad.movedim(1, -1)  # (S, *kernel, M)
        if rows.is_contiguous():
            # A channels_last gradient (a model moved to channels_last) is an (S * taps, M) matrix as it lies: one
            # product (matmul folds the leading dimensions of a contiguous operand), the result in the same layout.
            return torch.matmul(rows, q).movedim(-1, 1)
    # One (M x M) @ (M x S*K) product on the input-feature axis moved first (a copy of the small weight gradient),
    # written back in the gradient's layout: three ops, but on a CPU faster than the batched product for wide
    # layers.
    g = grad.transpose(0, 1).contiguous().view(m, -1)
    out = (q.t() @ g).view((m, s) + tuple(grad.shape[2:])).transpose(0, 1)
    if grad.is_contiguous():
        return out.contiguous()
    return torch.empty_like(grad).copy_(out)  # the gradient's own layout (channels_last)


def _grouped_weight_grad(grad: Tensor, q: Tensor) -> Tensor:
    """:func:`transform_weight_grad` for a grouped weight ``(S, k, *kernel)`` and blocks ``q`` ``(G, k, k)``."""
    g, k = q.shape[0], q.shape[-1]
    s = grad.shape[0]
    q = q.to(grad.dtype)
    if k == 1:  # depthwise: a scale per group, in the gradient's own layout
        scale = q.reshape(g, 1).expand(g, s // g).reshape((s,) + (1,) * (grad.dim() - 1))
        return grad * scale
    gr = grad.reshape(g, s // g, k, -1)  # (G, S/G, k, K)
    out = torch.matmul(q.transpose(-1, -2).unsqueeze(1), gr)
    return torch.empty_like(grad).copy_(out.reshape(grad.shape))
