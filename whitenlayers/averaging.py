"""Weight averaging (:class:`torch.optim.swa_utils.AveragedModel`) of converted models: counters kept, not averaged."""
from __future__ import annotations

from typing import Callable, List, Optional, Union

import torch
from torch import Tensor

__all__ = ["keep_counters"]

MultiAvgFn = Callable[[List[Tensor], List[Tensor], Union[Tensor, int]], None]
#: The device types whose multi-tensor kernels ``AveragedModel`` averages with (torch's list, less a privateuse1
#: backend).
FOREACH_DEVICES = ("cuda", "xpu")


def _swa_default() -> MultiAvgFn:
    """``AveragedModel``'s own equal average without ``avg_fn`` / ``multi_avg_fn``, operation for operation: the
    foreach one on a device with foreach kernels (CUDA), else one ``averaged + (model - averaged) / (n + 1)`` per
    tensor."""
    from torch.optim.swa_utils import get_swa_avg_fn, get_swa_multi_avg_fn

    multi, single = get_swa_multi_avg_fn(), get_swa_avg_fn()

    def swa(averaged: List[Tensor], current: List[Tensor], num_averaged: Union[Tensor, int]) -> None:
        if averaged[0].device.type in FOREACH_DEVICES:
            multi(averaged, current, num_averaged)
            return
        for a, c in zip(averaged, current):
            a.copy_(single(a, c, num_averaged))

    return swa


def keep_counters(multi_avg_fn: Optional[MultiAvgFn] = None) -> MultiAvgFn:
    """A ``multi_avg_fn`` for :class:`torch.optim.swa_utils.AveragedModel` that averages the floating-point
    tensors with ``multi_avg_fn`` and copies the integer ones from the model.

    With ``use_buffers=True`` ``AveragedModel`` averages every buffer, the
    integer counters included: a whitening layer's ``num_blocks`` (and a
    BatchNorm's ``num_batches_tracked``) then truncates to a number that is
    neither the model's nor any count (an EMA stays at the value of its first
    update: ``0`` when that came before the layer's first fold). A layer with
    ``num_blocks == 0`` counts as never folded: its diagnostics report no
    whitened covariance, and training it further (or :func:`torch.optim.swa_utils.update_bn`
    outside :func:`~whitenlayers.frozen` on a ``direct`` model) folds its next block
    as the first, replacing the averaged statistics instead of updating them.
    This function keeps every integer tensor equal to the model's (as timm's
    ``ModelEmaV3`` does), and averages the rest exactly as ``multi_avg_fn``.

    Args:
        multi_avg_fn: the average of the floating-point tensors, called as ``AveragedModel`` calls it (one
            device and dtype per call); default ``None``: ``AveragedModel``'s own equal average (SWA), with the
            same operations. For an EMA pass :func:`torch.optim.swa_utils.get_ema_multi_avg_fn`.

    Returns:
        The function to pass as ``AveragedModel(..., multi_avg_fn=...)``.

    Example:
        >>> import torch, whitenlayers as wl
        >>> from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
        >>> model = wl.convert_model(wl.models.resnet20(), method="grad", block_size=1)
        >>> ema = AveragedModel(model, multi_avg_fn=wl.keep_counters(get_ema_multi_avg_fn(0.999)), use_buffers=True)
        >>> for _ in range(3):
        ...     _ = model(torch.randn(2, 3, 8, 8))
        ...     ema.update_parameters(model)
        >>> int(wl.whitening_layers(ema.module)[0][1].num_blocks)
        3
    """
    average = _swa_default() if multi_avg_fn is None else multi_avg_fn

    @torch.no_grad()
    def keep_counters_avg(averaged: List[Tensor], current: List[Tensor], num_averaged: Union[Tensor, int]) -> None:
        if averaged and not (averaged[0].is_floating_point() or averaged[0].is_complex()):
            for a, c in zip(averaged, current):  # AveragedModel groups by dtype: a list of integer tensors
                a.copy_(c)
            return
        average(averaged, current, num_averaged)

    return keep_counters_avg
