"""The study's networks without BatchNorm and their gradient clipping: BatchNorm replaced by a per-channel affine
(Fixup-style, ``--norm none``), by GroupNorm (``--norm gn``) or by a normalizer-free ResNet (``--norm nf``), and
adaptive gradient clipping (``--agc``). :mod:`~whitenlayers.experiment.engine` builds its models with them."""
from __future__ import annotations

import math
from typing import Callable, Optional, cast

import torch
from torch import nn

from .. import models
from .config import RunConfig

__all__ = ["ChannelAffine", "remove_batchnorm", "ScaledStandardization", "ResidualGain", "normalizer_free",
           "group_norm_in_place_of_batchnorm", "make_clip"]


class ChannelAffine(nn.Module):
    """Per-channel scale and bias (what is left of a BatchNorm in the ``--norm none`` ResNet)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


def _replace_batchnorm(model: nn.Module, make: Callable[[int], nn.Module]) -> nn.Module:
    """Every ``BatchNorm2d`` of ``model`` replaced, in place, by ``make(num_features)`` on the BatchNorm's device."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.BatchNorm2d):
                setattr(parent, name, make(child.num_features).to(child.weight.device))
    return model


def remove_batchnorm(model: nn.Module) -> nn.Module:
    """Fixup-style (Zhang et al. 2019) CIFAR ResNet without BatchNorm, in place.

    Every BatchNorm2d becomes a :class:`ChannelAffine` (scale 1, bias 0); in
    each of the ``L`` residual blocks the first convolution is scaled by
    ``L^-1/2`` and the last is zero-initialised, as is the classifier, so
    every block starts as the identity and the output variance stays bounded.
    """
    blocks = [m for m in model.modules() if isinstance(m, models.BasicBlock)]
    _replace_batchnorm(model, ChannelAffine)
    with torch.no_grad():
        for b in blocks:
            b.conv1.weight.mul_(len(blocks) ** -0.5)
            b.conv2.weight.zero_()
        if isinstance(getattr(model, "fc", None), nn.Linear):
            cast(nn.Linear, model.fc).weight.zero_()
            cast(nn.Linear, model.fc).bias.zero_()
    return model


class ScaledStandardization(nn.Module):
    """Scaled weight standardisation (Brock et al. 2021, NF-ResNets), a parametrization of a convolution's
    weight: each output unit's weights centred and scaled to ``gamma / sqrt(fan_in)`` times unit variance, with
    ``gamma = sqrt(2 / (1 - 1/pi))`` (the ReLU's), so that a ReLU network keeps its signal's variance without
    normalising activations."""

    gamma = math.sqrt(2.0 / (1.0 - 1.0 / math.pi))

    def __init__(self, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        flat = w.flatten(1)
        var, mean = torch.var_mean(flat, dim=1, unbiased=False, keepdim=True)
        scale = self.gamma * torch.rsqrt(var * flat.shape[1] + self.eps)
        return ((flat - mean) * scale).view_as(w)


class ResidualGain(nn.Module):
    """A learnable scalar gain on a residual branch, initialised to 0 (SkipInit, De and Smith 2020): each block
    starts as the identity while its convolutions keep their ordinary initialisation."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def normalizer_free(model: nn.Module) -> nn.Module:
    """Normalizer-free CIFAR ResNet (NF-ResNet style, Brock et al. 2021), in place: every BatchNorm2d becomes a
    :class:`ChannelAffine` (scale 1, bias 0), every convolution's weight a scaled weight standardisation
    (:class:`ScaledStandardization`, weights left at their ordinary initialisation) and each residual block's
    branch ends in a zero-initialised scalar gain (:class:`ResidualGain`). Trained with ``--agc``, NFNets'
    adaptive gradient clipping, it is the normalizer-free arm; the convolutions stay ``nn.Conv2d``."""
    from torch.nn.utils import parametrize

    blocks = [m for m in model.modules() if isinstance(m, models.BasicBlock)]
    _replace_batchnorm(model, ChannelAffine)
    for b in blocks:
        b.bn2 = nn.Sequential(b.bn2, ResidualGain().to(b.conv2.weight.device))  # type: ignore[assignment]
    for m in list(model.modules()):
        if isinstance(m, nn.Conv2d):
            parametrize.register_parametrization(m, "weight", ScaledStandardization())
    return model


def group_norm_in_place_of_batchnorm(model: nn.Module) -> nn.Module:
    """Every ``BatchNorm2d`` of ``model`` replaced by a ``GroupNorm`` over the same channels (groups of 4 channels,
    at most 32 groups, Wu and He's default; scale 1, bias 0), in place: batch statistics never mix samples."""
    return _replace_batchnorm(model, lambda c: nn.GroupNorm(min(32, max(1, c // 4)), c))


def make_clip(cfg: RunConfig, model: nn.Module) -> Optional[Callable[[], None]]:
    """``--agc``: the gradient clipping run after the backward (after unscaling under a GradScaler), before the
    step: NFNets' adaptive gradient clipping (pytorch-optimizer's ``agc``: each output unit's gradient norm at most
    ``agc`` times its weight norm, weights below 1e-3 counted as 1e-3) on every parameter but the classifier's, as
    Brock et al. (2021) do; ``None`` when off."""
    ratio = float(cfg.agc)
    if ratio <= 0.0:
        return None
    try:
        from pytorch_optimizer.optimizer.agc import agc
    except ImportError as exc:  # pragma: no cover - the peers extra is installed wherever the runner is tested
        raise RuntimeError("--agc needs pytorch-optimizer: pip install 'whitenlayers[peers]'") from exc
    head = getattr(model, "fc", None)
    left_out = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in left_out]

    @torch.no_grad()
    def clip() -> None:
        for p in params:
            if p.grad is not None:
                p.grad.copy_(agc(p, p.grad, agc_clip_val=ratio))

    return clip
