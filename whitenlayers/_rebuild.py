"""One helper per module type to build a layer with another layer's settings (conversion, export, ``to_conv``)."""
from __future__ import annotations

from typing import Any, Optional, cast

from torch import nn
from torch.nn.utils import parametrize

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


def share_parameters(src: nn.Module, dst: nn.Module) -> None:
    """Give ``dst`` ``src``'s ``weight`` and ``bias``: the same Parameter objects (an optimizer built on ``src``
    keeps working) and, where ``src`` is parametrized (``torch.nn.utils.parametrize``: ``weight_norm``,
    ``spectral_norm``, ...), its parametrizations: the same modules (their state, e.g. spectral norm's ``u``, is
    shared) over the same original Parameters. No parametrization runs a training step here (they are registered
    in eval mode: spectral norm's power iteration does not advance)."""
    if parametrize.is_parametrized(src):
        mods = list(cast(nn.Module, src.parametrizations).modules())
        modes = [m.training for m in mods]
        dst_mode = dst.training
        dst.eval()  # registering sets a parametrization's mode to its host's
        try:
            parametrize.transfer_parametrizations_and_params(src, dst)
        finally:
            for m, mode in zip(mods, modes):
                m.training = mode
            dst.training = dst_mode
    for name in ("weight", "bias"):
        if not parametrize.is_parametrized(src, name):
            setattr(dst, name, getattr(src, name))
