"""The whitening layers and their base class.

* :class:`DirectWhiten`: ``y = T (x - mu)`` inserted before a layer (paper section 2);
  :class:`DirectWhitenWrapper`: one in front of a conv or linear layer.
* :class:`GradWhitenConv2d` / :class:`GradWhitenLinear`: drop-in ``nn.Conv2d`` / ``nn.Linear`` that centre their
  input on the running mean and right-multiply their weight gradient by ``Q_s`` (paper section 3, EVD transform);
  :class:`GradWhitenConv1d` / :class:`GradWhitenConv3d` the same for ``nn.Conv1d`` / ``nn.Conv3d``.
* :class:`RecursiveWhitenConv2d` (and 1-D, 3-D, linear): the same layers with the recursive ``O(M^2)`` transform
  update (paper section 4).
* :class:`WhiteningLayer`: the base of every whitening layer (buffers, block, fold).

One module per concern, from the bottom up: ``_checks`` (input checks and their messages), ``block`` (a layer's
partial block), ``step`` (the forward: one path for every call), ``checkpoint`` (state dicts, pickling), ``base``
(:class:`WhiteningLayer`), ``grad`` (what the grad / recursive layers share besides their forward), ``conv`` (those
layers), ``direct``. The classes keep ``whitenlayers.layers`` as their module path (their documented name, and the
one pickles of whole models record).

Centring convention (docs/conventions.md): a convolution computes ``z = conv(pad(x) - mu, W) + b``, i.e. it centres
*after* padding, which equals ``conv(x, W) + (b - sum_k W_k mu)``: the plain convolution with an adjusted bias, so no
centred copy of the activation is made or saved, and any ``padding_mode`` works. Grouped convolutions whiten each
group's ``M/G`` input channels on their own (block-diagonal ``T`` and ``Q_s`` kept as ``(G, k, k)``; depthwise is a
per-channel gain). After ``layer.absorb_centring(bn)`` (which :func:`~whitenlayers.convert_model` calls where the
output feeds a BatchNorm and nothing else) the layer skips the offset ``s = c - sum_k W_k mu`` while ``bn`` normalises
with batch statistics, and keeps ``d`` (buffer ``absorbed_offset``), the offset averaged as ``bn``'s running mean,
which it adds back whenever ``bn`` uses its running statistics.
"""
from __future__ import annotations

from .base import WhiteningLayer
from .conv import (
    GradWhitenConv1d,
    GradWhitenConv2d,
    GradWhitenConv3d,
    GradWhitenLinear,
    RecursiveWhitenConv1d,
    RecursiveWhitenConv2d,
    RecursiveWhitenConv3d,
    RecursiveWhitenLinear,
    _GradWhitenConvNd,
)
from .direct import DirectWhiten, DirectWhitenWrapper
from .grad import _GradWhitenMixin
from .step import recomputing

__all__ = ["DirectWhiten", "DirectWhitenWrapper", "GradWhitenConv1d", "GradWhitenConv2d", "GradWhitenConv3d",
           "GradWhitenLinear", "RecursiveWhitenConv1d", "RecursiveWhitenConv2d", "RecursiveWhitenConv3d",
           "RecursiveWhitenLinear", "WhiteningLayer", "recomputing"]

#: Every grad / recursive whitening layer class (conv of any dimension and linear).
GRAD_LAYER_TYPES = (GradWhitenConv1d, GradWhitenConv2d, GradWhitenConv3d, GradWhitenLinear)

for _cls in (WhiteningLayer, DirectWhiten, DirectWhitenWrapper, _GradWhitenMixin, _GradWhitenConvNd, GradWhitenConv1d,
             GradWhitenConv2d, GradWhitenConv3d, GradWhitenLinear, RecursiveWhitenConv1d, RecursiveWhitenConv2d,
             RecursiveWhitenConv3d, RecursiveWhitenLinear):
    _cls.__module__ = __name__
del _cls
