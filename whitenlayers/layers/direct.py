"""``DirectWhiten``: whitening of the features themselves, ``y = T (x - mu)`` (paper section 2).
Part of :mod:`whitenlayers.layers`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import functional as F_w
from ..autograd import POINTWISE_DIMS, _transform_mean, direct_whiten, pointwise_whiten
from ..config import EVDConfig
from ..rules import rule_and_config
from ..stats import WhiteningLayer, _is_compiling

if TYPE_CHECKING:  # pragma: no cover
    pass

from ._base import (
    _cacheable,
    _check_gathering_untransformed,
    _check_input,
    _check_not_tracing_function,
    _with_whitening_signature,
)


class DirectWhiten(WhiteningLayer, nn.Module):
    """Direct feature whitening ``y = T (x - mu)`` along dim 1 (paper section 2, EVD transform).

    Inputs ``(B, C)`` or ``(B, C, *spatial)``. In training mode each forward adds
    the batch to the block statistics (of ``x``); after ``block_size`` training
    forwards the block is folded in and ``mu``, ``T`` are updated. The backward
    is ``dx = T^T dy`` with ``T`` and ``mu`` constants; nothing activation-sized
    is saved for backward.

    ``groups=G`` whitens each of ``G`` groups of ``C/G`` consecutive features
    on its own (the input whitening of a ``groups=G`` convolution):
    ``whitening_matrix`` and ``running_cov`` are then the ``(G, C/G, C/G)``
    diagonal blocks (see the module docstring; depthwise ``C/G = 1`` is a
    per-channel gain).

    Args:
        num_features: ``C``, the size of dim 1 of the input (the features whitened), an integer >= 1. No
            default.
        config: the whitening hyper-parameters as one :class:`~whitenlayers.EVDConfig` (less ``beta``, which
            this layer does not take); ``None`` (default) takes the config's defaults. Keyword arguments
            below override its values.
        process_group: under ``torch.distributed``, the group whose ranks sum their block statistics at a
            fold (default ``None``: the default group, i.e. every rank; a single process ignores it). Change
            it only to whiten per sub-group of ranks.
        rule: keyword-only: the transform rule, as for :class:`~whitenlayers.GradWhitenConv2d` (its ``T`` is
            applied to the features: a rule of one's own should give a symmetric one).
        device: where the buffers are created (default ``None``: the current default device), as for
            ``nn.Module`` layers.
        dtype: floating dtype of the buffers (default ``None``: the default dtype, float32); float64 for
            float64 inputs. The statistics are accumulated in float64 either way.
        groups: ``G`` >= 1, a divisor of ``num_features`` (default 1: one ``C x C`` transform). Set it to the
            ``groups`` of the convolution this layer feeds, so that each group's features are whitened on
            their own.
        block_size, alpha, eps, stats_fraction, accumulation_steps, stats_every, gmax, gains:
            keyword-only: the :class:`~whitenlayers.EVDConfig` field of that name (meaning, range, default).

    Example:
        >>> import torch, whitenlayers as wl
        >>> layer = wl.DirectWhiten(3, block_size=1)
        >>> y = layer(torch.randn(16, 3, 4, 4) * torch.tensor([1.0, 5.0, 0.2]).view(1, 3, 1, 1))
        >>> int(layer.num_blocks), tuple(layer.whitening_matrix.shape)
        (1, (3, 3))
    """

    _CONFIG_CLASS = EVDConfig
    _unused_fields = ("beta",)  # no gradient transform to smooth
    _FORWARD_BUFFERS = ("running_mean", "whitening_matrix")

    @_with_whitening_signature(EVDConfig, exclude=_unused_fields)
    def __init__(
        self,
        num_features: int,
        *,
        config: Optional[EVDConfig] = None,
        process_group: Any = None,
        device=None,
        dtype=None,
        groups: int = 1,
        **whitening: Any,
    ) -> None:
        nn.Module.__init__(self)
        rule, cfg = rule_and_config(EVDConfig, type(self).__name__, config, whitening, exclude=self._unused_fields)
        self._check_config(cfg)
        self._init_whitening(num_features, cfg, grad_transform=False, process_group=process_group, device=device,
                             dtype=dtype, groups=groups, rule=rule)

    def _check_config(self, config: Any) -> None:
        """``ValueError`` for ``gains="damped"``: its ``T`` is a Cholesky factor's inverse, not symmetric, and this
        layer applies ``T`` to the features (a non-symmetric ``T`` would rotate them anew at every fold)."""
        if getattr(config, "gains", None) == "damped":
            raise ValueError(f"{type(self).__name__}: gains='damped' gives a non-symmetric T (sqrt(c) L^-1, from a "
                             "Cholesky factor), which the direct method applies to the features, rotating them "
                             "anew at every fold; use gains='practical' or 'zca' with method='direct', or "
                             "gains='damped' with method='grad', but got gains='damped'")

    def _pointwise_weights(self, t: Tensor, mean: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
        """``T`` as a 1x1 convolution's ``(M, M/G)`` weight, the bias ``-T mu`` and ``T^T``'s weight, in ``dtype``:
        made once per block (cached by tensor and version, like the grad layers' centring), in the graph when
        compiled."""
        key = (t, t._version, mean, mean._version, dtype) if not _is_compiling() else None
        cached = self._pointwise_cache
        if key is not None and cached is not None and cached[0] is t and cached[2] is mean and cached[1:5] == key[1:]:
            return cached[5]
        m = self.num_features
        with torch.no_grad():
            w = t.reshape(m, -1).to(dtype).contiguous()
            wt = t.transpose(-1, -2).reshape(m, -1).to(dtype).contiguous()
            b = _transform_mean(t, mean).neg_().to(dtype)
        if key is not None and _cacheable(t) and _cacheable(mean):
            self._pointwise_cache = key + ((w, b, wt),)
        return w, b, wt

    def extra_repr(self) -> str:
        rest = self._whitening_repr()
        if self.groups != 1:
            rest = f"groups={self.groups}" + (f", {rest}" if rest else "")
        return f"{self.num_features}" + (f", {rest}" if rest else "")

    def _begin(self, x: Tensor) -> Tuple[bool, Dict[str, Tensor]]:
        """A forward's first half: the input checks, and in training mode the batch added to the block statistics;
        whether it is a training batch and the buffers it reads (``_forward_state``). The second half is
        ``_end_batch()`` after the output, for a training batch (:class:`~whitenlayers.DirectWhitenWrapper` runs
        the two around the layer it whitens for)."""
        _check_input(self, x, dim=1, ndims=tuple(range(2, 9)), what="an input of shape (B, C) or (B, C, *spatial)")
        training, state = self._forward_state()
        if training:
            _check_gathering_untransformed(self)
            self._accumulate(x)
        return training, state

    def _shift_for(self, mean: Tensor, x: Tensor, features_last: bool) -> Tensor:
        """``mu`` as ``x`` subtracts it (``x``'s dtype; on dim 1, or the last dim when ``features_last``): made once
        per block (cached by tensor and version), in the graph when compiled."""
        shape = (-1,) if features_last else (1, -1) + (1,) * (x.dim() - 2)
        if _is_compiling():
            return mean.to(x.dtype).view(shape)
        cached = self.__dict__.get("_shift_cache")
        if (cached is not None and cached[0] is mean and cached[1] == mean._version and cached[2] == x.dtype
                and cached[3] == shape):
            return cached[4]
        value = mean.to(x.dtype).view(shape)
        if _cacheable(mean) and _cacheable(x):
            self.__dict__["_shift_cache"] = (mean, mean._version, x.dtype, shape, value)
        return value

    def forward(self, x: Tensor) -> Tensor:
        """``T (x - mu)`` along dim 1; in training mode the batch also joins the block statistics.

        Args:
            x: the input, ``(B, C)`` or ``(B, C, *spatial)`` with ``C = num_features``, floating point.

        Returns:
            The whitened input, same shape and dtype.
        """
        training, state = self._begin(x)
        t = state["whitening_matrix"]
        grads = torch.is_grad_enabled() and x.requires_grad
        if grads:
            _check_not_tracing_function(self, "the whitening's backward")
        if x.dim() in POINTWISE_DIMS and F_w.fused_moments_on(x.device):
            # CUDA: one 1x1 convolution each way. A CPU keeps the matrix products below: there the convolution was
            # slower (ResNet-20 step 1.33x against 1.26x).
            w, b, wt = self._pointwise_weights(t, state["running_mean"], x.dtype)
            out = pointwise_whiten(x, w, b, wt, self.groups)
        else:
            if grads and t is self._buffers["whitening_matrix"]:
                # the buffer itself (a forward traced by torch.jit), which a fold writes in place: the backward
                # must use the T of this forward. A snapshot (every other forward) is never written.
                t = t.clone()
            out = direct_whiten(x, t, state["running_mean"])
        if training:
            self._end_batch()
        return out
