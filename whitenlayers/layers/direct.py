"""Direct whitening of the features themselves (paper section 2): :class:`DirectWhiten`, ``y = T (x - mu)``, and
:class:`DirectWhitenWrapper`, a ``DirectWhiten`` in front of a conv or linear layer (what ``convert_model(...,
method="direct")`` puts in place of a target), which multiplies the layer's weight by ``T`` instead of whitening
its input where that is the same. Part of :mod:`whitenlayers.layers`."""
from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .._torch_compat import no_autocast
from ..autograd import (
    POINTWISE_DIMS,
    _transform_mean,
    direct_whiten,
    pointwise_whiten,
    transformed_weight,
    transformed_weight_apply,
)
from ..config import EVDConfig
from ..functional import batch as _batch
from ..privacy import note_direct
from ..rules import EVDRule
from ._checks import check_input, check_not_tracing_function
from .base import WhiteningLayer, split_options, whitening_signature

__all__ = ["DirectWhiten", "DirectWhitenWrapper"]

#: DirectWhiten's input check (``check_input``'s ranks and wording).
_INPUT_DIMS = tuple(range(2, 9))
_INPUT_WHAT = "an input of shape (B, C) or (B, C, *spatial)"
#: The layers whose weight DirectWhitenWrapper multiplies by T instead of whitening their input.
_FUSED_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


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

    _unused_fields = ("beta",)  # no gradient transform to smooth
    _FORWARD_BUFFERS = ("running_mean", "whitening_matrix")

    def __init__(self, num_features: int, *, device: Any = None, dtype: Optional[torch.dtype] = None,
                 groups: int = 1, **kwargs: Any) -> None:
        nn.Module.__init__(self)
        options, whitening = split_options(kwargs)
        self._init_whitening(num_features, options, whitening, grad_transform=False, device=device, dtype=dtype,
                             groups=groups)

    def _check_config(self, config: Any, rule: Any = None) -> None:
        """``ValueError`` for ``gains="damped"`` with the EVD rule's update (``rule``: the rule class, default the
        layer's): its ``T`` is a Cholesky factor's inverse, not symmetric, and this layer applies ``T`` to the
        features, which a non-symmetric ``T`` would rotate anew at every fold. A rule of one's own computes its own
        ``T`` (it should be symmetric for this layer) and may read ``gains`` as it likes."""
        rule = type(self.rule) if rule is None else rule
        if getattr(config, "gains", None) == "damped" and getattr(rule, "update", None) is EVDRule.update:
            raise ValueError(f"{type(self).__name__}: gains='damped' makes the EVD rule give a non-symmetric T "
                             "(sqrt(c) L^-1, from a Cholesky factor), which the direct method applies to the features, "
                             "rotating them anew at every fold; use gains='practical' or 'zca' with method='direct', "
                             "or gains='damped' with method='grad', but got gains='damped'")

    def extra_repr(self) -> str:
        groups = f"groups={self.groups}" if self.groups != 1 else ""
        return ", ".join(part for part in (f"{self.num_features}", groups, self._whitening_repr()) if part)

    def forward(self, x: Tensor) -> Tensor:
        """``T (x - mu)`` along dim 1; in training mode the batch also joins the block statistics.

        Args:
            x: the input, ``(B, C)`` or ``(B, C, *spatial)`` with ``C = num_features``, floating point.

        Returns:
            The whitened input, same shape and dtype.
        """
        check_input(self, x, None, dim=1, ndims=_INPUT_DIMS, what=_INPUT_WHAT)
        step = self._begin(x)
        reads = step.reads
        t, mean = reads.state["whitening_matrix"], reads.state["running_mean"]
        if torch.is_grad_enabled() and x.requires_grad:
            check_not_tracing_function(self, "the whitening's backward")
        if x.dim() in POINTWISE_DIMS and (x.device.type != "cpu" or _batch._fused_on_cpu):
            # CUDA: one 1x1 convolution each way, T, -T mu and T^T made once per fold for a training forward. A CPU
            # keeps the matrix products below: there the convolution was slower (ResNet-20 step 1.33x against 1.26x).
            w, b, wt = self._derived(reads, ("pointwise", x.dtype), lambda: self._pointwise_weights(t, mean, x.dtype))
            out = pointwise_whiten(x, w, b, wt, self.groups)
        else:
            out = direct_whiten(x, t, mean)
        if step.counts:
            self._end(step, None)
        return out

    @torch.no_grad()
    def _pointwise_weights(self, t: Tensor, mean: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
        """``T`` as a 1x1 convolution's ``(M, M/G)`` weight, the bias ``-T mu`` and ``T^T``'s weight, in ``dtype``."""
        return (t.reshape(self.num_features, -1).to(dtype).contiguous(), _transform_mean(t, mean).neg_().to(dtype),
                t.transpose(-1, -2).reshape(self.num_features, -1).to(dtype).contiguous())


DirectWhiten.__init__.__signature__ = whitening_signature(  # type: ignore[attr-defined]
    list(inspect.signature(DirectWhiten.__init__).parameters.values())[:-1], EVDConfig, DirectWhiten._unused_fields)


class DirectWhitenWrapper(nn.Module):
    """``layer(whiten(x))``: a :class:`~whitenlayers.DirectWhiten` in front of a conv or linear layer.

    What ``convert_model(..., method="direct")`` puts in place of a target.
    ``layer`` is the original module object (same Parameters, same
    state-dict hooks); the forward/backward hooks that were registered on it
    are moved to this wrapper, so they see the same input and output as
    before the conversion.

    Args:
        whiten: the :class:`~whitenlayers.DirectWhiten` applied first; its ``num_features`` (and
            ``groups``) must match ``layer``'s input (``in_channels`` / ``in_features``).
        layer: the conv or linear layer applied to the whitened input, unchanged.
    """

    def __init__(self, whiten: DirectWhiten, layer: nn.Module) -> None:
        super().__init__()
        self.whiten = whiten
        self.layer = layer
        note_direct(self)  # Opacus' validator checks the wrapped layer (whitenlayers.privacy)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        note_direct(self)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # The whitening layer's check of a checkpoint of another method: a grad / recursive layer's keys sit here,
        # at the wrapper's place, which the DirectWhiten's own load (given only its keys) does not see.
        self.whiten._check_checkpoint_method(state_dict, prefix + "whiten.")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _fusable(self) -> bool:
        """Whether the forward multiplies the layer's weight by ``T`` (:meth:`forward`): a plain conv or linear layer,
        a dense ``T``, and no hook on either module that would see its call (a global module hook sees the
        wrapper's call only)."""
        modules: Dict[str, Any] = self._modules
        whiten, layer = modules["whiten"], modules["layer"]
        return type(layer) in _FUSED_LAYERS and whiten.groups == 1 and not (
            whiten._forward_hooks or whiten._forward_pre_hooks or whiten._backward_hooks
            or whiten._backward_pre_hooks or layer._forward_hooks or layer._forward_pre_hooks
            or layer._backward_hooks or layer._backward_pre_hooks)

    def forward(self, x: Tensor) -> Tensor:
        """``layer(whiten(x))``, computed as ``layer(x - mu)`` with the weight ``W T`` where that is the same.

        A plain conv or linear layer (``nn.Conv1d/2d/3d``, ``nn.Linear``) after a dense ``T`` (``groups=1``), with
        no hooks on either module, takes its weight times ``T`` on the input-feature axis instead of the whitened
        input: ``conv(pad(T (x - mu)), W) = conv(pad(x - mu), W T)`` (every padding mode pads each position's
        features as a whole, which ``T`` does not mix), and the gradients of ``W`` and ``x`` are those of the
        whitened form (``dW = dW' T^T``, ``dx = T^T conv^T(dz, W)``), up to rounding. One subtraction on the input
        and one small product on the weight replace two 1x1 products over the activations (forward and
        backward). Otherwise (hooks, a grouped ``T``, another layer type) the two modules are called in turn.

        Args:
            x: the wrapped layer's input (features on dim 1 for a conv, on the last dim for an ``nn.Linear``).
        """
        modules: Dict[str, Any] = self._modules  # (read without Module.__getattr__: this runs in every step)
        whiten, layer = modules["whiten"], modules["layer"]
        if not self._fusable():
            if isinstance(layer, nn.Linear) and x.dim() != 2:
                # A linear layer acts on the last dim: whiten the (N, C) rows of x (statistics over all leading dims).
                return layer(whiten(x.reshape(-1, x.shape[-1])).reshape(x.shape))
            return layer(whiten(x))
        # Fused: layer(x - mu) with the weight W T.
        linear = type(layer) is nn.Linear
        feats = x.reshape(-1, x.shape[-1]) if linear and x.dim() != 2 else x
        if not (isinstance(feats, Tensor) and 2 <= feats.dim() <= 8 and feats.shape[1] == whiten.num_features
                and feats.is_floating_point()):
            check_input(whiten, feats, None, dim=1, ndims=_INPUT_DIMS, what=_INPUT_WHAT)
        step = whiten._begin(feats)
        reads = step.reads
        t, mean = reads.state["whitening_matrix"], reads.state["running_mean"]
        if not step.plain and torch.is_grad_enabled() and x.requires_grad:
            check_not_tracing_function(whiten, "the whitening's backward")  # as DirectWhiten's own forward
        params = layer._parameters
        w = params["weight"]
        # (a training step's eager forward, Step.plain: the Function itself, nothing to ask)
        product = transformed_weight_apply if step.plain else transformed_weight
        if torch.is_autocast_enabled(w.device.type):  # W T in the weight's dtype (not autocast's bf16 / fp16)
            with no_autocast(w.device):
                wt = product(w, t)
        else:
            wt = product(w, t)
        shape = (-1,) if linear else (1, -1) + (1,) * (x.dim() - 2)  # mu as x subtracts it (made once per fold)
        shift = whiten._derived(reads, ("shift", x.dtype, shape), lambda: mean.to(x.dtype).view(shape))
        if linear:
            out = nn.functional.linear(x - shift, wt, params["bias"])
        else:
            out = layer._conv_forward(x - shift, wt, params["bias"])
        if step.counts:
            whiten._end(step, None)
        return out
