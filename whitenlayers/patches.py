"""Patch features of a 2-D convolution: the unfolded ``C k^2`` input patch as the whitened feature vector.

An extension beyond the paper (docs/PAPER.md, "Extensions"; docs/conventions.md, "Patch whitening"). A
``GradWhitenConv2d(..., features="patches")`` whitens the vector of its ``C k_h k_w`` inputs at each output
position (the columns of ``F.unfold``) instead of its ``C`` channels: K-FAC's activation side for that layer,
and what airbench's patch-whitening stem does once at initialisation. The layer is then a linear map of its
unfolded input, ``z = W_flat (u - mu) + b`` with ``u = unfold(pad0(x))`` and ``W_flat = W.reshape(S, C k^2)``,
so everything the per-channel layers prove carries over with ``M = C k^2``: the equivalence property holds
with :class:`~whitenlayers.DirectWhiten` on the unfolded input, the centring offset ``W_flat mu`` is exact at
every output position (padded positions are zeros of the patch, counted in the statistics, as the centring
after zero padding of the per-channel layers), and the layer folds into a plain ``nn.Conv2d``.

Feature order: ``unfold``'s, channel-major (``c k_h k_w + i k_w + j``), which is the order of
``W.reshape(S, -1)``.

Cost: the statistics are a ``(C k^2)^2`` product per output position, so the option is meant for layers with
few input channels, above all the stem (``C = 1`` or ``3``). :data:`PATCH_MAX_FEATURES` guards
:func:`~whitenlayers.convert_model`'s ``stem_patches=True``.
"""
from __future__ import annotations

from typing import Tuple, Union

import torch.nn.functional as F
from torch import Tensor

__all__ = ["FEATURES", "PATCH_MAX_FEATURES", "patch_padding", "unfold_patches"]

#: The feature vectors a 2-D whitening convolution can whiten.
FEATURES = ("channels", "patches")

#: The largest ``C k_h k_w`` that ``convert_model(..., stem_patches=True)`` accepts without ``max_features``:
#: a ``1024 x 1024`` state and product per output position (a 7x7 RGB stem has 147, a 3x3 one 27).
PATCH_MAX_FEATURES = 1024


def patch_padding(kernel_size: Tuple[int, ...], dilation: Tuple[int, ...],
                  padding: Union[str, Tuple[int, ...]]) -> Tuple[int, int]:
    """The symmetric zero padding ``unfold`` needs for a conv's ``padding`` (``'valid'``, ``'same'`` or pairs).

    ``'same'`` is symmetric only when ``dilation * (k - 1)`` is even in both dimensions; otherwise
    ``ValueError``.

    Args:
        kernel_size: the conv's ``(k_h, k_w)``.
        dilation: the conv's ``(d_h, d_w)``.
        padding: the conv's ``padding``: ``"valid"``, ``"same"`` or a pair of ints.

    Returns:
        ``(p_h, p_w)``, the zero padding on each side.
    """
    if padding == "valid":
        return (0, 0)
    if padding == "same":
        total = [d * (k - 1) for d, k in zip(dilation, kernel_size)]
        if any(t % 2 for t in total):
            raise ValueError(f"features='patches' needs symmetric padding, but padding='same' with "
                             f"kernel_size={tuple(kernel_size)}, dilation={tuple(dilation)} pads asymmetrically")
        return (total[0] // 2, total[1] // 2)
    if isinstance(padding, str):
        raise ValueError(f"padding must be 'valid', 'same' or a pair of ints, but got padding={padding!r}")
    return (int(padding[0]), int(padding[1]))


def unfold_patches(x: Tensor, kernel_size: Tuple[int, ...], dilation: Tuple[int, ...], padding: Tuple[int, int],
                   stride: Tuple[int, ...]) -> Tensor:
    """``(B, C k_h k_w, L)``: every output position's zero-padded input patch, channel-major (``F.unfold``).

    Args:
        x: the conv's input, ``(B, C, H, W)``.
        kernel_size, dilation, stride: the conv's, as pairs.
        padding: the symmetric zero padding (:func:`patch_padding`).
    """
    return F.unfold(x, kernel_size, dilation=dilation, padding=padding, stride=stride)
