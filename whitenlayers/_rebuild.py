"""One helper per module type to build a layer with another layer's settings (conversion, export, ``to_conv``)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Optional, cast

from torch import nn
from torch.nn.utils import parametrize

_PLAIN_CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def plain_conv_class(conv: Any) -> type:
    """``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` by the dimension of ``conv``'s kernel."""
    return _PLAIN_CONVS[len(conv.kernel_size)]


def layer_like(layer: Any, cls: Optional[type] = None, *, bias: bool, **extra: Any) -> Any:
    """A new layer of class ``cls`` (default: the plain ``nn.Linear``, or the plain conv of ``layer``'s dimension)
    with ``layer``'s features (a conv's channels, kernel, stride, padding, dilation, groups and padding mode),
    device and dtype; fresh parameters."""
    factory = {"device": layer.weight.device, "dtype": layer.weight.dtype}
    if hasattr(layer, "in_features"):  # a linear layer
        return (cls or nn.Linear)(layer.in_features, layer.out_features, bias=bias, **factory, **extra)
    return (cls or plain_conv_class(layer))(
        layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride, padding=layer.padding,
        dilation=layer.dilation, groups=layer.groups, bias=bias, padding_mode=layer.padding_mode, **factory, **extra)


def share_parameters(src: nn.Module, dst: nn.Module) -> None:
    """Give ``dst`` ``src``'s ``weight`` and ``bias``: the same Parameter objects (an optimizer built on ``src``
    keeps working) and, where ``src`` is parametrized (``torch.nn.utils.parametrize``: ``weight_norm``,
    ``spectral_norm``, ...), its parametrizations: the same modules (their state, e.g. spectral norm's ``u``, is
    shared) over the same original Parameters. No parametrization runs a training step here (they are registered
    in eval mode: spectral norm's power iteration does not advance)."""
    if parametrize.is_parametrized(src):
        with modes_kept(list(cast(nn.Module, src.parametrizations).modules()) + [dst]):
            dst.eval()  # registering sets a parametrization's mode to its host's
            parametrize.transfer_parametrizations_and_params(src, dst)
    for name in ("weight", "bias"):
        if not parametrize.is_parametrized(src, name):
            setattr(dst, name, getattr(src, name))


@contextlib.contextmanager
def modes_kept(modules: Iterable[nn.Module]) -> Iterator[None]:
    """The training flags of ``modules`` (as they are on entry) restored on exit."""
    modes = [(m, m.training) for m in modules]
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
