"""The grad / recursive convolution (1-D, 2-D, 3-D) and linear layers (paper sections 3 and 4): the plain layer
with the forward of :mod:`~whitenlayers.layers.step` and its whitening keyword arguments. Part of
:mod:`whitenlayers.layers`."""
from __future__ import annotations

import inspect
from typing import Any, Dict, FrozenSet

import torch
from torch import Tensor, nn

from ..config import RecursiveConfig
from ..patches import FEATURES, patch_padding, unfold_patches
from .base import split_options, whitening_signature
from .grad import _GradWhitenMixin

__all__ = ["GradWhitenConv1d", "GradWhitenConv2d", "GradWhitenConv3d", "GradWhitenLinear", "RecursiveWhitenConv1d",
           "RecursiveWhitenConv2d", "RecursiveWhitenConv3d", "RecursiveWhitenLinear"]

_SPATIAL_WORDS = {1: "L", 2: "H, W", 3: "D, H, W"}
_DIMENSIONS = {nn.Linear: 0, nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}


class _GradWhitenLayer(_GradWhitenMixin):
    """A grad / recursive layer: the plain layer ``_PLAIN`` (``nn.Conv1d``, ``nn.Conv2d``, ``nn.Conv3d`` or
    ``nn.Linear``, the second base of the subclass) whitened by the rule of ``_CONFIG``. Its one constructor takes
    the plain layer's arguments, the options of :data:`~whitenlayers.layers.base.LAYER_OPTIONS` (and
    ``_EXTRA_OPTIONS``) and the config's fields; each subclass gets its signature from them."""

    _PLAIN: Any = nn.Conv2d
    #: Options of this class besides :data:`~whitenlayers.layers.base.LAYER_OPTIONS` (name: default).
    _EXTRA_OPTIONS: Dict[str, Any] = {}
    #: The plain class's constructor argument names (set per subclass from ``_PLAIN``'s signature).
    _PLAIN_NAMES: FrozenSet[str] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        nd = _DIMENSIONS[cls._PLAIN]
        cls._op = staticmethod(nn.functional.linear) if nd == 0 else cls._PLAIN._conv_forward  # the plain layer's
        cls._BATCHED_RANK, cls._SPATIAL = nd + 2, nd
        if nd:
            cls._INPUT = (-(nd + 1), (nd + 1, nd + 2), f"an input of shape (B, C, {_SPATIAL_WORDS[nd]}) or "
                                                        f"(C, {_SPATIAL_WORDS[nd]})")
        plain = list(inspect.signature(cls._PLAIN.__init__).parameters.values())[1:]  # (not self)
        cls._PLAIN_NAMES = frozenset(p.name for p in plain)

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            _GradWhitenLayer._construct(self, *args, **kwargs)

        __init__.__doc__ = cls.__doc__
        __init__.__signature__ = whitening_signature(  # type: ignore[attr-defined]
            [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *plain], cls._CONFIG,
            extra=cls._EXTRA_OPTIONS)
        cls.__init__ = __init__  # type: ignore[method-assign]

    def _construct(self, *args: Any, **kwargs: Any) -> None:
        """The plain layer built from ``args`` and its keywords, then the whitening state from the rest (options and
        config fields: unknown names are a ``TypeError`` naming the layer and what it takes)."""
        self._PLAIN.__init__(self, *args, **{k: v for k, v in kwargs.items() if k in self._PLAIN_NAMES})
        options, whitening = split_options({k: v for k, v in kwargs.items() if k not in self._PLAIN_NAMES},
                                           tuple(self._EXTRA_OPTIONS))
        layer: Any = self
        num_features, out_features = (layer.in_features, layer.out_features) if not self._SPATIAL else (
            layer.in_channels, layer.out_channels)
        features = options.get("features", "channels")
        if features not in FEATURES:
            raise ValueError(f"{type(self).__name__}: features must be one of {FEATURES}, "
                             f"but got features={features!r}")
        if features == "patches":
            if layer.groups != 1 or layer.padding_mode != "zeros":
                raise ValueError(f"{type(self).__name__}: features='patches' needs groups=1 and padding_mode='zeros', "
                                 f"but got groups={layer.groups}, padding_mode={layer.padding_mode!r}")
            self._patch_padding = patch_padding(layer.kernel_size, layer.dilation, layer.padding)
            num_features = layer.in_channels * layer.kernel_size[0] * layer.kernel_size[1]
            self.features = features
        weight = layer.weight
        self._init_whitening(num_features, options, whitening, grad_transform=True, device=weight.device,
                             dtype=weight.dtype, groups=getattr(layer, "groups", 1))
        # The compensation ``c`` of mean updates (ERRATA 8): a buffer, never written into a parameter (a sharded
        # wrapper holds the full bias only during the forward, and autograd may hold it until the backward).
        self.register_buffer("bias_correction", torch.zeros(out_features, device=weight.device,
                                                            dtype=self.running_mean.dtype))

    def _features_of(self, x: Tensor, weight: Tensor) -> Tensor:
        x = super()._features_of(x, weight)
        if self.features == "patches":  # the unfolded patches (B, C k^2, L)
            conv: Any = self
            return unfold_patches(x, conv.kernel_size, conv.dilation, self._patch_padding, conv.stride)
        return x

    @classmethod
    def from_conv(cls, conv: nn.Module, **kwargs: Any) -> Any:
        """A whitening conv computing the same function as ``conv``, sharing its Parameter objects.

        Weight and bias are the same ``nn.Parameter`` objects (an optimizer built on ``conv`` keeps working), so
        device, dtype and ``requires_grad`` carry over; so does the training flag.

        Args:
            conv: the plain conv of this class's dimension (``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d``) to convert
                (its constructor arguments are copied).
            **kwargs: the whitening keyword arguments of the constructor (``config``, ``process_group``,
                ``features``, ``block_size``, ...), with the same defaults.

        Returns:
            The new layer (``conv`` itself is left as it is).
        """
        return cls._from_plain(conv, cls._PLAIN, "from_conv", **kwargs)

    def to_conv(self) -> Any:
        """A plain conv of the same dimension with identical outputs (``mu`` folded into the bias); new Parameters.

        Identical to this layer's eval-mode outputs; the whitening state is dropped (the layer is left as it is).
        :func:`~whitenlayers.to_plain_model` does this for a whole model.
        """
        return self._to_plain(self._PLAIN)


# The layers by plain class: each the plain layer (second base) and its config, the constructor _GradWhitenLayer's.
_GradWhitenConvNd = _GradWhitenLayer


class GradWhitenConv2d(_GradWhitenLayer, nn.Conv2d):
    """Drop-in ``nn.Conv2d`` with gradient-based feature whitening (paper section 3).

    Forward: ``z = conv(pad0(x) - mu, W) + b`` (centred after zero padding;
    statistics are those of ``x`` before padding). Backward: the weight
    gradient is right-multiplied by ``Q_s`` on the input-channel axis, per
    kernel tap; the bias gradient is untouched. When a fold changes ``mu``
    the bias (or, for ``bias=False``, the non-trainable ``bias_correction``
    buffer) is compensated so the layer's function is unchanged.

    Centring: ``layer.centring`` is ``"input"`` (the default: the layer
    centres as above) or, after ``layer.absorb_centring(bn)``, ``"absorbed"``:
    the output feeds the BatchNorm ``bn`` and nothing else, and the layer
    skips the centring offset while ``bn`` normalises with batch statistics
    (see :meth:`absorb_centring`; :func:`~whitenlayers.convert_model` does
    this where it can tell). ``extra_repr`` shows ``centring=absorbed``.

    ``groups=G`` whitens per group (block-diagonal ``T`` and ``Q_s`` stored as
    ``(G, k, k)``; depthwise is a per-channel gain; see the module docstring).

    ``M = in_channels`` features are whitened (with ``groups=G``, each
    group's ``in_channels / G`` on their own); any ``padding_mode`` works
    (the input is centred after padding).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode:
            as for ``nn.Conv2d``: same meaning and defaults.
        device, dtype: as for ``nn.Conv2d`` (default ``None``); they also place the whitening buffers
            (float32, or float64 for a float64 layer).
        config: the whitening hyper-parameters as one :class:`~whitenlayers.EVDConfig`; ``None`` (default)
            takes its defaults. The keyword arguments below override its values.
        process_group: under ``torch.distributed``, the group whose ranks sum their block statistics at a
            fold (default ``None``: the default group, every rank; ignored by a single process). Change it
            only to whiten per sub-group of ranks.
        rule: keyword-only: the transform rule, a :class:`~whitenlayers.TransformRule` subclass or a registered
            name (default: the built-in rule of the config, EVD here); a rule's config subclass adds its own
            keyword arguments ("Writing a rule" in the docs).
        features: what a feature vector is: ``"channels"`` (default, the paper: the ``M`` input channels at
            each position) or ``"patches"`` (the unfolded ``M k_h k_w`` input patch: K-FAC's activation
            side; needs ``groups=1`` and ``padding_mode="zeros"``). Patches whiten more but cost
            ``(M k_h k_w)^2`` statistics: use them for small stems (:mod:`whitenlayers.patches`).
        block_size, alpha, eps, stats_fraction, accumulation_steps, stats_every, beta, gmax, gains:
            keyword-only: the :class:`~whitenlayers.EVDConfig` field of that name (meaning, range, default).

    Example:
        >>> import torch, whitenlayers as wl
        >>> conv = wl.GradWhitenConv2d(8, 16, 3, padding=1, bias=False, block_size=2)
        >>> x = torch.randn(4, 8, 10, 10) + 3
        >>> _ = conv(x); _ = conv(x)      # two training forwards: one block
        >>> int(conv.num_blocks)
        1
        >>> conv.eval()(x).shape
        torch.Size([4, 16, 10, 10])
    """

    _PLAIN = nn.Conv2d
    _EXTRA_OPTIONS = {"features": "channels"}


class GradWhitenConv1d(_GradWhitenLayer, nn.Conv1d):
    """Drop-in ``nn.Conv1d`` with gradient-based feature whitening: :class:`GradWhitenConv2d` for ``(B, C, L)``.

    ``z = conv(pad0(x) - mu, W) + b``, weight gradient times ``Q_s`` per kernel
    tap, ``groups`` supported (block-diagonal whitening), same whitening
    keyword arguments, :meth:`from_conv` / :meth:`to_conv`.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode:
            as for ``nn.Conv1d``: same meaning and defaults (``M = in_channels`` features are whitened).
        device, dtype: as for ``nn.Conv1d`` (default ``None``); they also place the whitening buffers.
        config, process_group, rule: as for :class:`GradWhitenConv2d` (an :class:`~whitenlayers.EVDConfig` or
            ``None`` for its defaults; the ranks that sum the statistics, default every rank).
        block_size, alpha, eps, stats_fraction, accumulation_steps, stats_every, beta, gmax, gains:
            keyword-only: the :class:`~whitenlayers.EVDConfig` field of that name (meaning, range, default).

    Example:
        >>> import torch, whitenlayers as wl
        >>> conv = wl.GradWhitenConv1d(4, 8, 5, padding=2, block_size=2)
        >>> _ = conv(torch.randn(3, 4, 50)); _ = conv(torch.randn(3, 4, 50))
        >>> int(conv.num_blocks), tuple(conv.grad_transform.shape)
        (1, (4, 4))
    """

    _PLAIN = nn.Conv1d


class GradWhitenConv3d(_GradWhitenLayer, nn.Conv3d):
    """Drop-in ``nn.Conv3d`` with gradient-based feature whitening: :class:`GradWhitenConv2d` for
    ``(B, C, D, H, W)``.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode:
            as for ``nn.Conv3d``: same meaning and defaults (``M = in_channels`` features are whitened).
        device, dtype: as for ``nn.Conv3d`` (default ``None``); they also place the whitening buffers.
        config, process_group, rule: as for :class:`GradWhitenConv2d` (an :class:`~whitenlayers.EVDConfig` or
            ``None`` for its defaults; the ranks that sum the statistics, default every rank).
        block_size, alpha, eps, stats_fraction, accumulation_steps, stats_every, beta, gmax, gains:
            keyword-only: the :class:`~whitenlayers.EVDConfig` field of that name (meaning, range, default).
    """

    _PLAIN = nn.Conv3d


# nn.Linear's stubs declare ``bias: Parameter``, though it is None for bias=False (as the layers' stubs declare).
class GradWhitenLinear(_GradWhitenLayer, nn.Linear):  # type: ignore[misc]
    """Drop-in ``nn.Linear`` with gradient-based feature whitening (paper section 3).

    ``z = (x - mu) W^T + b`` computed as ``x W^T + (b - W mu)``; the weight
    gradient is right-multiplied by ``Q_s``. Inputs ``(*, in_features)``;
    statistics over all leading dimensions. Whitening keyword arguments as for
    :class:`GradWhitenConv2d`; the centring can be absorbed by a following
    ``BatchNorm1d`` (:meth:`absorb_centring`, ``(B, in_features)`` inputs).

    Args:
        in_features, out_features, bias: as for ``nn.Linear``: same meaning and defaults (``M = in_features``).
        device, dtype: as for ``nn.Linear`` (default ``None``); they also place the whitening buffers.
        config: the whitening hyper-parameters as one :class:`~whitenlayers.EVDConfig` (default ``None``: its
            defaults); the keyword arguments below override its values.
        process_group, rule: as for :class:`GradWhitenConv2d` (default ``None``: every rank; the built-in
            rule).
        block_size, alpha, eps, stats_fraction, accumulation_steps, stats_every, beta, gmax, gains:
            keyword-only: the :class:`~whitenlayers.EVDConfig` field of that name (meaning, range, default).

    Example:
        >>> import torch, whitenlayers as wl
        >>> fc = wl.GradWhitenLinear(6, 3, block_size=2)
        >>> _ = fc(torch.randn(8, 6)); _ = fc(torch.randn(8, 6))
        >>> int(fc.num_blocks), tuple(fc.grad_transform.shape)
        (1, (6, 6))
    """

    _PLAIN = nn.Linear


    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs: Any) -> "GradWhitenLinear":
        """A whitening linear layer computing the same function, sharing ``linear``'s Parameter objects.

        Args:
            linear: the ``nn.Linear`` to convert (sizes, device, dtype, ``requires_grad`` and training flag
                carry over).
            **kwargs: the whitening keyword arguments of the constructor (``config``, ``process_group``,
                ``block_size``, ...), with the same defaults.
        """
        return cls._from_plain(linear, nn.Linear, "from_linear", **kwargs)

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` with identical outputs (``mu`` folded into the bias); new Parameters."""
        return self._to_plain(nn.Linear)


class RecursiveWhitenConv2d(GradWhitenConv2d):
    """:class:`GradWhitenConv2d` with the recursive transform update (paper section 4).

    At each fold a high-power direction ``v_e`` of ``Phi_y`` (the covariance of
    the whitened features) is found by column alignment, its power is reduced
    to ``delta * mean(phi_x)`` by a rank-one step, and a leakage ``gamma``
    pulls ``T`` toward ``I``. Building ``T(i)`` and ``Q(i)`` costs ``O(M^2)``.
    Tracking ``Phi_y`` as ``alpha Phi_y + (1-alpha) T(i-1) C_block T(i-1)^T``
    costs two ``M x M`` matrix products per fold (``O(M^3)``, once per block,
    never per batch). Extra buffers: ``running_cov_whitened`` (``Phi_y``),
    ``running_power`` (``phi_x,m``, uncentred) and ``whitening_gram``
    (unsmoothed ``Q``).

    Defaults are the paper's: ``alpha=0.1, beta=0.1, gamma=0.99, delta=0.25,
    c_rel=0.025, c_abs=1e-6, eps=1e-5``. When the found direction already
    holds less power than the target (``g_e > 1``) the gain is clamped to 1
    (ERRATA 6): no amplification, only the leakage acts; counted in
    ``clamped_steps``.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode:
            as for :class:`GradWhitenConv2d` (``nn.Conv2d``'s arguments and defaults).
        device, dtype, process_group, features, rule: as for :class:`GradWhitenConv2d`: same meaning and
            defaults (a rule of one's own takes a :class:`~whitenlayers.RecursiveConfig` here).
        config: the whitening hyper-parameters as one :class:`~whitenlayers.RecursiveConfig` (default
            ``None``: its defaults); the keyword arguments below override its values.
        block_size, alpha, eps, stats_fraction, accumulation_steps, stats_every, beta, gamma, delta, c_rel, c_abs:
            keyword-only: the :class:`~whitenlayers.RecursiveConfig` field of that name (meaning, range,
            default).

    Example:
        >>> import torch, whitenlayers as wl
        >>> conv = wl.RecursiveWhitenConv2d(4, 8, 3, padding=1, block_size=1, gamma=0.95)
        >>> _ = conv(torch.randn(2, 4, 6, 6))
        >>> int(conv.num_blocks), conv.config.gamma
        (1, 0.95)
    """

    _CONFIG = RecursiveConfig


class RecursiveWhitenConv1d(GradWhitenConv1d):
    """:class:`GradWhitenConv1d` with the recursive transform update; see :class:`RecursiveWhitenConv2d`.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode:
            as for :class:`GradWhitenConv1d` (``nn.Conv1d``'s arguments and defaults).
        device, dtype, process_group, rule: as for :class:`GradWhitenConv1d`: same meaning and defaults.
        config: the whitening hyper-parameters as one :class:`~whitenlayers.RecursiveConfig` (default
            ``None``: its defaults); the keyword arguments below override its values.
        block_size, alpha, eps, stats_fraction, accumulation_steps, stats_every, beta, gamma, delta, c_rel, c_abs:
            keyword-only: the :class:`~whitenlayers.RecursiveConfig` field of that name (meaning, range,
            default).
    """

    _CONFIG = RecursiveConfig


class RecursiveWhitenConv3d(GradWhitenConv3d):
    """:class:`GradWhitenConv3d` with the recursive transform update; see :class:`RecursiveWhitenConv2d`.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode:
            as for :class:`GradWhitenConv3d` (``nn.Conv3d``'s arguments and defaults).
        device, dtype, process_group, rule: as for :class:`GradWhitenConv3d`: same meaning and defaults.
        config: the whitening hyper-parameters as one :class:`~whitenlayers.RecursiveConfig` (default
            ``None``: its defaults); the keyword arguments below override its values.
        block_size, alpha, eps, stats_fraction, accumulation_steps, stats_every, beta, gamma, delta, c_rel, c_abs:
            keyword-only: the :class:`~whitenlayers.RecursiveConfig` field of that name (meaning, range,
            default).
    """

    _CONFIG = RecursiveConfig


class RecursiveWhitenLinear(GradWhitenLinear):
    """:class:`GradWhitenLinear` with the recursive transform update; see :class:`RecursiveWhitenConv2d`.

    Args:
        in_features, out_features, bias, device, dtype, process_group, rule: as for :class:`GradWhitenLinear`
            (``nn.Linear``'s arguments and defaults).
        config: the whitening hyper-parameters as one :class:`~whitenlayers.RecursiveConfig` (default
            ``None``: its defaults); the keyword arguments below override its values.
        block_size, alpha, eps, stats_fraction, accumulation_steps, stats_every, beta, gamma, delta, c_rel, c_abs:
            keyword-only: the :class:`~whitenlayers.RecursiveConfig` field of that name (meaning, range,
            default).
    """

    _CONFIG = RecursiveConfig
