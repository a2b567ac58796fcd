"""The whitening layers.

* :class:`DirectWhiten`: ``y = T (x - mu)`` inserted before a layer (paper section 2).
* :class:`GradWhitenConv2d` / :class:`GradWhitenLinear`: drop-in ``nn.Conv2d`` /
  ``nn.Linear`` that centre their input on the running mean and right-multiply
  their weight gradient by ``Q_s`` (paper section 3, EVD transform).
* :class:`RecursiveWhitenConv2d` / :class:`RecursiveWhitenLinear`: the same
  layers with the recursive ``O(M^2)`` transform update (paper section 4).
* :class:`GradWhitenConv1d` / :class:`GradWhitenConv3d` and
  :class:`RecursiveWhitenConv1d` / :class:`RecursiveWhitenConv3d`: the same for
  ``nn.Conv1d`` / ``nn.Conv3d`` (audio, sequence and video models).

Centring convention (``docs/PAPER.md``, "Conventions"): a convolution computes
``z = conv(pad(x) - mu, W) + b``, i.e. it centres *after* padding. This equals
``conv(x, W) + (b - sum_k W_k mu)``, which is how it is computed: the plain
convolution with an adjusted bias, so no centred copy of the activation is
made or saved, and autograd produces the centred weight gradient by itself.
Any ``padding_mode`` is supported under this convention (the identity holds
for every padding mode).

Grouped convolutions (``docs/PAPER.md``, "Conventions"): a conv with ``groups=G``
whitens each group's ``k = M/G`` input channels on their own. ``T`` and
``Q_s`` are block-diagonal (one ``k x k`` block per group, kept as a
``(G, k, k)`` tensor), the statistics are the diagonal blocks of ``Phi_x``
(never the full ``M x M`` product), the EVD gains are those of the whole
block-diagonal ``Phi_x`` (normalised by the layer's mean eigenvalue), and the
weight gradient of group ``g``'s ``S/G`` output channels is right-multiplied by
``Q_g``. So the equivalence of paper section 3.1 holds per group: the layer
with weights ``W_g T_g`` trains like ``DirectWhiten(groups=G)`` followed by the
grouped conv with weights ``W_g``. **Depthwise** (``k = 1``, ``groups ==
in_channels``): ``T`` and ``Q_s`` are diagonal, i.e. a per-channel gain; with
the default practical gains channel ``c`` gets ``g_c = min(mean_c' var_c' /
var_c, gmax)`` (``T_c = sqrt(g_c)``) if it is among the ``round(M_s)``
highest-variance channels (``M_s`` the effective rank of the channel
variances) and 1 otherwise: the strong channels are standardised to the
layer's mean variance, gains capped at ``gmax``, the weakest channels left
alone; ``gains="zca"`` gives plain standardisation ``1 / max(var_c, eps)``.
The gradient transform then scales each output channel's weight gradient by
its input channel's gain, which is what training on standardised inputs
amounts to for a depthwise conv.

Centring absorbed by a following BatchNorm (docs/conventions.md): after
``layer.absorb_centring(bn)`` (which :func:`~whitenlayers.convert_model` calls
where the output feeds a BatchNorm and nothing else) the layer skips the
per-channel offset ``s = c - sum_k W_k mu`` whenever ``bn`` normalises with
batch statistics, because ``bn`` removes any per-channel constant and its
input gradient sums to zero per channel, so the offset's weight-gradient
term vanishes too; training is unchanged up to rounding. The BatchNorm's
``running_mean`` then averages ``conv(x)`` instead of ``conv(x) + s``; the
layer keeps the difference, ``d`` (buffer ``absorbed_offset``: ``s``
averaged with the BatchNorm's own momentum), and whenever ``bn`` uses its
running statistics (eval mode, or a frozen BatchNorm) it adds ``s - d``:
``bn`` then sees exactly what it sees after the centred layer.
"""
from __future__ import annotations

# One module per concern (_base: what the grad / recursive layers share; direct; conv: 2-D and linear; convnd:
# 1-D and 3-D); the classes keep ``whitenlayers.layers`` as their module path (their documented name, and the
# one pickles of whole models recorded before the split).
from .._deprecated import module_getattr
from ..stats import WhiteningLayer
from ._base import _autocast_enabled, _check_input, _GradWhitenMixin  # noqa: F401
from .conv import GradWhitenConv2d, GradWhitenLinear, RecursiveWhitenConv2d, RecursiveWhitenLinear
from .convnd import (
    GradWhitenConv1d,
    GradWhitenConv3d,
    RecursiveWhitenConv1d,
    RecursiveWhitenConv3d,
    _GradWhitenConvNd,
)
from .direct import DirectWhiten

__all__ = [
    "DirectWhiten",
    "GradWhitenConv1d",
    "GradWhitenConv2d",
    "GradWhitenConv3d",
    "RecursiveWhitenConv1d",
    "RecursiveWhitenConv3d",
    "GradWhitenLinear",
    "RecursiveWhitenConv2d",
    "RecursiveWhitenLinear",
    "WhiteningLayer",
]

#: Every grad / recursive whitening layer class (conv of any dimension and linear).
GRAD_LAYER_TYPES = (GradWhitenConv1d, GradWhitenConv2d, GradWhitenConv3d, GradWhitenLinear)

for _cls in (DirectWhiten, _GradWhitenMixin, _GradWhitenConvNd, GradWhitenConv1d, GradWhitenConv2d, GradWhitenConv3d,
             GradWhitenLinear, RecursiveWhitenConv1d, RecursiveWhitenConv2d, RecursiveWhitenConv3d,
             RecursiveWhitenLinear):
    _cls.__module__ = __name__
del _cls

__getattr__ = module_getattr("whitenlayers.layers", "WhiteningStatistics")
