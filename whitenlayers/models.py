"""ResNet definitions used by the experiments.

* :func:`cifar_resnet` (and :func:`resnet20` ... :func:`resnet110`): the CIFAR
  ResNets of He et al. 2016 ("Deep Residual Learning for Image Recognition",
  section 4.2): a 3x3 stem convolution, three stages of ``n`` residual blocks
  with ``width``, ``2 width`` and ``4 width`` channels (feature maps 32, 16, 8
  for 32x32 inputs), global average pooling and a linear classifier; depth
  ``6n + 2``. Shortcuts are **option A**: parameter-free, a strided subsample
  followed by zero padding of the new channels, so a block holds exactly two
  convolutions and ResNet-110 has ``54 * 2 = 108`` convolutions inside its
  blocks (the count the paper whitens; the stem conv and the classifier are
  not inside a block).
* :func:`resnet50`: torchvision's ResNet-50 (an optional dependency).

The residual block class is named ``BasicBlock``, the name
:func:`whitenlayers.convert_model` recognises by default.

Example:
    >>> import torch, whitenlayers as wl
    >>> model = wl.models.resnet20(num_classes=10)
    >>> model(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "BasicBlock",
    "ShortcutA",
    "CifarResNet",
    "cifar_resnet",
    "resnet20",
    "resnet32",
    "resnet44",
    "resnet56",
    "resnet110",
    "resnet50",
]


class ShortcutA(nn.Module):
    """Option-A shortcut (He et al. 2016): ``x[:, :, ::s, ::s]`` with zero channels appended.

    Parameter-free: the identity on the existing channels, zeros for the
    ``out_channels - in_channels`` new ones.

    Args:
        in_channels: channels of the input, an integer >= 1.
        out_channels: channels of the output, ``>= in_channels`` (the extra ones are zeros).
        stride: spatial subsampling step, an integer >= 1 (1: none).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        if out_channels < in_channels:
            raise ValueError(
                f"ShortcutA can only add channels, but got in_channels={in_channels}, out_channels={out_channels}"
            )
        self.in_channels, self.out_channels, self.stride = in_channels, out_channels, stride

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, stride={self.stride}"

    def forward(self, x: Tensor) -> Tensor:
        if self.stride != 1:
            x = x[:, :, :: self.stride, :: self.stride]
        extra = self.out_channels - self.in_channels
        if extra:
            x = F.pad(x, (0, 0, 0, 0, 0, extra))
        return x


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and ReLU, plus an option-A shortcut.

    Args:
        in_channels: channels of the block's input, an integer >= 1.
        channels: channels of both convolutions and of the output, an integer >= 1.
        stride: stride of the first convolution and of the shortcut (default 1; 2 halves the resolution at
            the start of a stage).
    """

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        if stride != 1 or in_channels != channels:
            self.shortcut: nn.Module = ShortcutA(in_channels, channels, stride)
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """CIFAR ResNet of depth ``6 * blocks_per_stage + 2`` (see :func:`cifar_resnet`).

    Module names follow torchvision (``conv1``, ``bn1``, ``layer1``..``layer3``,
    ``fc``), so checkpoints and predicates read the same.

    Args:
        blocks_per_stage: ``n``, the :class:`BasicBlock` count of each of the three stages, an integer >= 1.
        num_classes: outputs of the classifier (default 10).
        in_channels: channels of the input images (default 3; 1 for grayscale).
        width: channels of the first stage, doubled at each later stage (default 16, the paper's).
        zero_init_residual: zero each block's last BatchNorm scale, so blocks start as identities
            (default ``False``).
    """

    def __init__(
        self, blocks_per_stage: int, num_classes: int = 10, in_channels: int = 3, width: int = 16,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages = []
        c_in = width
        for i, stride in enumerate((1, 2, 2)):
            c_out = width * 2**i  # the first block of a stage changes the channels and the resolution
            stages.append(nn.Sequential(BasicBlock(c_in, c_out, stride),
                                        *(BasicBlock(c_out, c_out) for _ in range(blocks_per_stage - 1))))
            c_in = c_out
        self.layer1, self.layer2, self.layer3 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)
        # Kaiming (He et al. 2015) initialisation of the convolutions, as in torchvision; BatchNorms start at (1, 0).
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif zero_init_residual and isinstance(m, BasicBlock):
                nn.init.zeros_(m.bn2.weight)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, but got {name}={value!r}")


def cifar_resnet(
    depth: int = 20, num_classes: int = 10, in_channels: int = 3, width: int = 16, *, zero_init_residual: bool = False
) -> CifarResNet:
    """He et al. 2016 CIFAR ResNet with option-A shortcuts, depth ``6n + 2``.

    The paper's depths are 20, 32, 44, 56 and 110 (any ``6n + 2`` with ``n >= 1``
    is accepted; 8 and 14 make small test models). ``in_channels=1`` for
    grayscale data; ``width`` is the first stage's channel count (16 in the
    paper). Convolutions get Kaiming-normal (fan-out) weights, BatchNorm
    ``(1, 0)``; ``zero_init_residual`` zeroes each block's last BN scale.

    Args:
        depth: ``6n + 2`` with ``n >= 1`` (default 20).
        num_classes: outputs of the classifier, an integer >= 1 (default 10; 100 for CIFAR-100).
        in_channels: channels of the input images, an integer >= 1 (default 3; 1 for grayscale).
        width: channels of the first stage, an integer >= 1 (default 16, the paper's; 8 for quick CPU runs).
        zero_init_residual: zero each block's last BatchNorm scale (default ``False``).

    Example:
        >>> import whitenlayers as wl
        >>> sum(p.numel() for p in wl.models.cifar_resnet(20).parameters())
        269722
    """
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 8 or (depth - 2) % 6 != 0:
        raise ValueError(f"depth must be 6n + 2 with n >= 1 (e.g. 20, 32, 44, 56, 110), but got depth={depth!r}")
    _check_positive_int("num_classes", num_classes)
    _check_positive_int("in_channels", in_channels)
    _check_positive_int("width", width)
    return CifarResNet((depth - 2) // 6, num_classes, in_channels, width, zero_init_residual)


def resnet20(**kw: Any) -> CifarResNet:
    """CIFAR ResNet-20 (18 convolutions inside blocks).

    Args:
        **kw: ``num_classes``, ``in_channels``, ``width``, ``zero_init_residual`` of :func:`cifar_resnet`.
    """
    return cifar_resnet(20, **kw)


def resnet32(**kw: Any) -> CifarResNet:
    """CIFAR ResNet-32 (30 convolutions inside blocks).

    Args:
        **kw: ``num_classes``, ``in_channels``, ``width``, ``zero_init_residual`` of :func:`cifar_resnet`.
    """
    return cifar_resnet(32, **kw)


def resnet44(**kw: Any) -> CifarResNet:
    """CIFAR ResNet-44 (42 convolutions inside blocks).

    Args:
        **kw: ``num_classes``, ``in_channels``, ``width``, ``zero_init_residual`` of :func:`cifar_resnet`.
    """
    return cifar_resnet(44, **kw)


def resnet56(**kw: Any) -> CifarResNet:
    """CIFAR ResNet-56 (54 convolutions inside blocks).

    Args:
        **kw: ``num_classes``, ``in_channels``, ``width``, ``zero_init_residual`` of :func:`cifar_resnet`.
    """
    return cifar_resnet(56, **kw)


def resnet110(**kw: Any) -> CifarResNet:
    """CIFAR ResNet-110 (108 convolutions inside blocks, the paper's count).

    Args:
        **kw: ``num_classes``, ``in_channels``, ``width``, ``zero_init_residual`` of :func:`cifar_resnet`.
    """
    return cifar_resnet(110, **kw)


def resnet50(num_classes: int = 1000, *, in_channels: int = 3, **kw: Any) -> nn.Module:
    """torchvision's ResNet-50 (untrained; ``weights`` may be passed through ``kw``).

    Needs torchvision (``pip install whitenlayers[vision]``); raises
    ``ImportError`` saying so when it is missing. ``in_channels != 3`` replaces
    the stem convolution by a freshly initialised one with that many input
    channels. Converted with the default targets it has 52 whitening layers
    (16 ``Bottleneck`` blocks of three convolutions, plus four downsample
    convolutions).

    Args:
        num_classes: outputs of the classifier, an integer >= 1 (default 1000, ImageNet).
        in_channels: channels of the input images, an integer >= 1 (default 3).
        **kw: passed to ``torchvision.models.resnet50`` (e.g. ``weights``, ``zero_init_residual``).
    """
    try:
        import torchvision
    except ImportError as exc:  # pragma: no cover - exercised with torchvision hidden
        raise ImportError(
            "whitenlayers.models.resnet50 needs torchvision, which is not installed; "
            "install it with `pip install torchvision` (or `pip install whitenlayers[vision]`)"
        ) from exc
    _check_positive_int("in_channels", in_channels)
    model = torchvision.models.resnet50(num_classes=num_classes, **kw)
    if in_channels != 3:
        old = model.conv1
        model.conv1 = nn.Conv2d(in_channels, old.out_channels, old.kernel_size, stride=old.stride,
                                padding=old.padding, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    return model
