"""The 1-D and 3-D convolution grad / recursive layers: :class:`GradWhitenConv2d`'s rules for other
dimensions. Part of :mod:`whitenlayers.layers`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Optional, Tuple, Type, Union, cast

from torch import Tensor, nn
from torch.nn.common_types import _size_1_t, _size_3_t

from ..config import EVDConfig, RecursiveConfig

if TYPE_CHECKING:  # pragma: no cover
    pass

from ._base import _check_input, _GradWhitenMixin, _weight_once, _with_whitening_signature


class _GradWhitenConvNd(_GradWhitenMixin):
    """Grad/recursive whitening for ``nn.Conv1d`` / ``nn.Conv3d``: :class:`GradWhitenConv2d`'s forward, any dimension.

    Subclasses put the plain conv class second in their bases and set ``_PLAIN``.
    """

    _PLAIN: Type[nn.Module] = nn.Conv1d

    if TYPE_CHECKING:  # pragma: no cover
        # Provided by the plain conv class (``_PLAIN``) a subclass combines this mixin with.
        in_channels: int
        out_channels: int
        kernel_size: Tuple[int, ...]
        stride: Tuple[int, ...]
        padding: Union[str, Tuple[int, ...]]
        dilation: Tuple[int, ...]
        padding_mode: Literal["zeros", "reflect", "replicate", "circular"]

        def __init__(self, *args: Any, **kwargs: Any) -> None: ...

        def _conv_forward(self, input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor: ...

    def _init_convnd(self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                     padding_mode, device, dtype, config, process_group, whitening) -> None:
        self._PLAIN.__init__(cast(nn.Module, self), in_channels, out_channels, kernel_size, stride, padding, dilation,
                             groups, bias, padding_mode, device, dtype)
        self._init_grad_whitening(in_channels, out_channels, config, whitening, process_group, device, dtype,
                                  groups=groups)

    def forward(self, x: Tensor) -> Tensor:
        """The convolution of the centred input; in training mode the batch also joins the block statistics.

        Args:
            x: the input, ``(B, C, *spatial)`` or unbatched ``(C, *spatial)`` with ``C = in_channels`` and the
                conv's number of spatial dimensions, floating point.

        Returns:
            What the plain conv returns for it, here ``conv(pad0(x) - mu, W) + b``.
        """
        nd = len(self.kernel_size)
        plan = self._take_plan(x, nd + 2)  # a training forward planned by the model's fold coordinator
        if plan is not None:  # (never a parametrized weight: such a layer is not planned)
            return self._planned_conv_forward(x, plan, nd)
        return self._full_forward(x)

    @_weight_once
    def _full_forward(self, x: Tensor) -> Tensor:
        nd = len(self.kernel_size)
        spatial = {1: "L", 2: "H, W", 3: "D, H, W"}[nd]
        _check_input(self, x, dim=-(nd + 1), ndims=(nd + 1, nd + 2),
                     what=f"an input of shape (B, C, {spatial}) or (C, {spatial})")
        return self._whitened_conv_forward(x, nd)

    @classmethod
    def from_conv(cls, conv: nn.Module, **kwargs: Any) -> "_GradWhitenConvNd":
        """A whitening conv computing the same function as ``conv``, sharing its Parameter objects (as
        :meth:`GradWhitenConv2d.from_conv`).

        Args:
            conv: the plain conv of this class's dimension (``nn.Conv1d`` / ``nn.Conv3d``) to convert.
            **kwargs: the whitening keyword arguments of the constructor (``config``, ``process_group``,
                ``block_size``, ...), with the same defaults.
        """
        return cls._from_plain_conv(conv, cls._PLAIN, **kwargs)

    def to_conv(self) -> nn.Module:
        """A plain conv of the same dimension with identical outputs (``mu`` folded into the bias); new Parameters."""
        return self._to_plain_conv(self._PLAIN)


class GradWhitenConv1d(_GradWhitenConvNd, nn.Conv1d):
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

    @_with_whitening_signature(EVDConfig)
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _size_1_t,
        stride: _size_1_t = 1,
        padding: Union[str, _size_1_t] = 0,
        dilation: _size_1_t = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        config: Optional[EVDConfig] = None,
        process_group: Any = None,
        **whitening: Any,
    ) -> None:
        self._init_convnd(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                          padding_mode, device, dtype, config, process_group, whitening)


class GradWhitenConv3d(_GradWhitenConvNd, nn.Conv3d):
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

    @_with_whitening_signature(EVDConfig)
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _size_3_t,
        stride: _size_3_t = 1,
        padding: Union[str, _size_3_t] = 0,
        dilation: _size_3_t = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        config: Optional[EVDConfig] = None,
        process_group: Any = None,
        **whitening: Any,
    ) -> None:
        self._init_convnd(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                          padding_mode, device, dtype, config, process_group, whitening)


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

    @_with_whitening_signature(RecursiveConfig)
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _size_1_t,
        stride: _size_1_t = 1,
        padding: Union[str, _size_1_t] = 0,
        dilation: _size_1_t = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        config: Optional[RecursiveConfig] = None,
        process_group: Any = None,
        **whitening: Any,
    ) -> None:
        self._init_convnd(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                          padding_mode, device, dtype, config, process_group, whitening)


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

    @_with_whitening_signature(RecursiveConfig)
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _size_3_t,
        stride: _size_3_t = 1,
        padding: Union[str, _size_3_t] = 0,
        dilation: _size_3_t = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        config: Optional[RecursiveConfig] = None,
        process_group: Any = None,
        **whitening: Any,
    ) -> None:
        self._init_convnd(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                          padding_mode, device, dtype, config, process_group, whitening)
