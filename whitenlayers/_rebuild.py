"""One helper per module type to build a layer with another layer's settings (conversion, export, ``to_conv``)."""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

_PLAIN_CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def plain_conv_class(conv: Any) -> type:
    """``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` by the dimension of ``conv``'s kernel."""
    return _PLAIN_CONVS[len(conv.kernel_size)]


def conv_like(conv: Any, cls: Optional[type] = None, *, bias: bool, **extra: Any) -> Any:
    """A new conv of class ``cls`` (default: the plain conv of ``conv``'s dimension) with ``conv``'s channels,
    kernel, stride, padding, dilation, groups, padding mode, device and dtype; fresh parameters."""
    cls = cls if cls is not None else plain_conv_class(conv)
    return cls(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
               dilation=conv.dilation, groups=conv.groups, bias=bias, padding_mode=conv.padding_mode,
               device=conv.weight.device, dtype=conv.weight.dtype, **extra)


def linear_like(linear: Any, cls: type = nn.Linear, *, bias: bool, **extra: Any) -> Any:
    """A new linear layer of class ``cls`` with ``linear``'s features, device and dtype; fresh parameters."""
    return cls(linear.in_features, linear.out_features, bias=bias, device=linear.weight.device,
               dtype=linear.weight.dtype, **extra)
