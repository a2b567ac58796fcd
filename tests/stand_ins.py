"""Small stand-ins of other architecture families, for the tests and ``docs/coverage.py``.

They have the module structure (and class names) of the real ones, so conversion rules that look at class
names treat them alike, without torchvision, timm or transformers installed. Not part of the layers' API.

* :func:`mobilenet_like`: MobileNetV2's inverted residual blocks (1x1 expand, depthwise 3x3, 1x1 project).
* :func:`resnext_like`: torchvision's ResNeXt (``Bottleneck`` blocks with a grouped 3x3).
* :func:`vit_like`: a Vision Transformer (patch-embedding conv, attention and MLP ``nn.Linear`` layers,
  optionally torch's ``nn.MultiheadAttention`` as torchvision uses).
* :func:`hf_resnet_like`: Hugging Face transformers' ``ResNetForImageClassification`` (``ResNetBottleNeckLayer``
  / ``ResNetBasicLayer`` blocks).
* :class:`BatchNormAct2d` and :func:`timm_mobilenet_like`: timm's fused BatchNorm + activation (a ``BatchNorm2d``
  subclass with a forward of its own), in the inverted residual blocks of timm's EfficientNet / MobileNet.

Example:
    >>> import torch
    >>> import stand_ins
    >>> stand_ins.mobilenet_like(width=4)(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""
from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["InvertedResidual", "mobilenet_like", "Bottleneck", "resnext_like", "vit_like", "hf_resnet_like",
           "ResNetConvLayer", "ResNetShortCut", "ResNetBottleNeckLayer", "ResNetBasicLayer", "BatchNormAct2d",
           "timm_mobilenet_like"]


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    if act:
        layers.append(nn.ReLU6(inplace=True))
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand (omitted for ``expand == 1``), depthwise 3x3, linear 1x1 project.

    The residual connection is used when ``stride == 1`` and the channel
    counts match, as in torchvision's ``InvertedResidual``.
    """

    def __init__(self, cin: int, cout: int, stride: int = 1, expand: int = 4) -> None:
        super().__init__()
        hidden = cin * expand
        layers = [] if expand == 1 else [_conv_bn(cin, hidden, 1)]
        layers += [_conv_bn(hidden, hidden, 3, stride, groups=hidden), _conv_bn(hidden, cout, 1, act=False)]
        self.conv = nn.Sequential(*layers)
        self.use_res_connect = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv(x)
        return x + out if self.use_res_connect else out


class _MobileNetLike(nn.Module):
    def __init__(self, num_classes: int, in_channels: int, width: int) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            _conv_bn(in_channels, w, 3, 2),
            InvertedResidual(w, w, 1, expand=1),
            InvertedResidual(w, 2 * w, 2),
            InvertedResidual(2 * w, 2 * w, 1),
            InvertedResidual(2 * w, 4 * w, 2),
            InvertedResidual(4 * w, 4 * w, 1),
            _conv_bn(4 * w, 8 * w, 1),
        )
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(8 * w, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


def mobilenet_like(num_classes: int = 10, in_channels: int = 3, width: int = 8) -> nn.Module:
    """A small MobileNetV2: stem conv, five :class:`InvertedResidual` blocks, 1x1 head conv, linear classifier.

    16 convolutions (the stem, 4 expand, 5 depthwise (``groups == channels``)
    and 5 project convolutions, the head conv) and the classifier. Its blocks
    are not named like ResNet blocks, so the default targets convert nothing;
    ``targets="all"`` converts the 15 convolutions after the stem.
    """
    return _MobileNetLike(num_classes, in_channels, width)


class Bottleneck(nn.Module):
    """torchvision's ``Bottleneck`` with ``groups`` (a ResNeXt block): 1x1, grouped 3x3 (stride), 1x1 (x4).

    The class name is the one :func:`whitenlayers.convert_model` recognises.
    """

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Any = None, groups: int = 1,
                 width: int = 0) -> None:
        super().__init__()
        width = width or planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class _ResNeXtLike(nn.Module):
    def __init__(self, layers, groups: int, width_per_group: int, width: int, num_classes: int,
                 in_channels: int) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages = []
        for i, n in enumerate(layers):
            planes = width * 2**i
            stride = 1 if i == 0 else 2
            downsample = None
            if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
                downsample = nn.Sequential(
                    nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride=stride, bias=False),
                    nn.BatchNorm2d(planes * Bottleneck.expansion),
                )
            inner = groups * width_per_group * 2**i
            blocks = [Bottleneck(self.inplanes, planes, stride, downsample, groups, inner)]
            self.inplanes = planes * Bottleneck.expansion
            blocks += [Bottleneck(self.inplanes, planes, 1, None, groups, inner) for _ in range(1, n)]
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(self.inplanes, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnext_like(layers=(1, 1, 1, 1), *, groups: int = 4, width_per_group: int = 2, width: int = 8,
                 num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """torchvision's ResNeXt structure at a small width: ``layers=(3, 4, 6, 3)`` is ResNeXt-50's layout.

    Each stage ``i`` has ``Bottleneck`` blocks whose 3x3 conv has ``groups``
    groups of ``width_per_group * 2**i`` channels. With ``(3, 4, 6, 3)`` the
    default targets are the 52 block convolutions, 16 of them grouped.
    """
    if len(layers) != 4:
        raise ValueError(f"layers must have 4 stages, but got layers={layers!r}")
    return _ResNeXtLike(tuple(layers), groups, width_per_group, width, num_classes, in_channels)


class _Attention(nn.Module):
    """timm-style self-attention: one ``qkv`` ``nn.Linear``, then the output ``proj``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class _TorchAttention(nn.Module):
    """torchvision-style: ``nn.MultiheadAttention`` (its projections are not module calls)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


class _EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_dim: int, attention: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads) if attention == "linear" else _TorchAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _ViTLike(nn.Module):
    def __init__(self, image_size: int, patch_size: int, dim: int, depth: int, heads: int, mlp_dim: int,
                 num_classes: int, in_channels: int, attention: str) -> None:
        super().__init__()
        self.conv_proj = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        n = (image_size // patch_size) ** 2
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[_EncoderBlock(dim, heads, mlp_dim, attention) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
        return self.head(self.norm(self.blocks(x))[:, 0])


def vit_like(image_size: int = 16, patch_size: int = 4, *, dim: int = 16, depth: int = 2, heads: int = 2,
             mlp_dim: int = 32, num_classes: int = 10, in_channels: int = 3, attention: str = "linear") -> nn.Module:
    """A small Vision Transformer: patch-embedding conv (the stem), ``depth`` pre-norm encoder blocks, linear head.

    ``attention="linear"`` (timm's layout): each block has four ``nn.Linear``
    layers (``qkv``, ``proj`` and the two of the MLP), which
    ``targets="all"`` converts (``4 * depth`` layers). ``attention="mha"``
    (torchvision's layout): ``nn.MultiheadAttention``, whose projections no
    whitening layer can replace; only the MLP's two layers per block convert.
    """
    if attention not in ("linear", "mha"):
        raise ValueError(f"attention must be 'linear' or 'mha', but got attention={attention!r}")
    return _ViTLike(image_size, patch_size, dim, depth, heads, mlp_dim, num_classes, in_channels, attention)


class ResNetConvLayer(nn.Module):
    """Hugging Face's ``ResNetConvLayer``: ``convolution``, ``normalization``, ``activation``."""

    def __init__(self, cin: int, cout: int, kernel_size: int = 3, stride: int = 1, activation: bool = True) -> None:
        super().__init__()
        self.convolution = nn.Conv2d(cin, cout, kernel_size, stride=stride, padding=kernel_size // 2, bias=False)
        self.normalization = nn.BatchNorm2d(cout)
        self.activation = nn.ReLU() if activation else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.activation(self.normalization(self.convolution(x)))


class ResNetShortCut(nn.Module):
    """Hugging Face's ``ResNetShortCut``: a strided 1x1 ``convolution`` and ``normalization``."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.convolution = nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
        self.normalization = nn.BatchNorm2d(cout)

    def forward(self, x: Tensor) -> Tensor:
        return self.normalization(self.convolution(x))


class ResNetBottleNeckLayer(nn.Module):
    """Hugging Face's ``ResNetBottleNeckLayer``: ``shortcut`` and ``layer`` (1x1 reduce, 3x3, 1x1 expand)."""

    def __init__(self, cin: int, cout: int, stride: int = 1, reduction: int = 4) -> None:
        super().__init__()
        reduced = cout // reduction
        self.shortcut = ResNetShortCut(cin, cout, stride) if (cin != cout or stride != 1) else nn.Identity()
        self.layer = nn.Sequential(
            ResNetConvLayer(cin, reduced, 1),
            ResNetConvLayer(reduced, reduced, 3, stride),
            ResNetConvLayer(reduced, cout, 1, activation=False),
        )
        self.activation = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.activation(self.layer(x) + self.shortcut(x))


class ResNetBasicLayer(nn.Module):
    """Hugging Face's ``ResNetBasicLayer``: ``shortcut`` and ``layer`` (two 3x3 convolutions)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.shortcut = ResNetShortCut(cin, cout, stride) if (cin != cout or stride != 1) else nn.Identity()
        self.layer = nn.Sequential(ResNetConvLayer(cin, cout, 3, stride),
                                   ResNetConvLayer(cout, cout, 3, activation=False))
        self.activation = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.activation(self.layer(x) + self.shortcut(x))


class _HFResNetStage(nn.Module):
    def __init__(self, block: type, cin: int, cout: int, stride: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(block(cin, cout, stride), *[block(cout, cout) for _ in range(depth - 1)])

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class _HFResNetModel(nn.Module):
    def __init__(self, block: type, depths, hidden_sizes, embedding_size: int, in_channels: int) -> None:
        super().__init__()
        self.embedder = nn.Sequential()
        self.embedder.embedder = ResNetConvLayer(in_channels, embedding_size, 7, stride=2)
        self.embedder.pooler = nn.MaxPool2d(3, stride=2, padding=1)
        self.encoder = nn.Module()
        stages, cin = [], embedding_size
        for i, (depth, cout) in enumerate(zip(depths, hidden_sizes)):
            stages.append(_HFResNetStage(block, cin, cout, 1 if i == 0 else 2, depth))
            cin = cout
        self.encoder.stages = nn.ModuleList(stages)
        self.pooler = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.embedder(x)
        for stage in cast(nn.ModuleList, self.encoder.stages):
            x = stage(x)
        return self.pooler(x)


class _HFResNetForImageClassification(nn.Module):
    def __init__(self, block: type, depths, hidden_sizes, embedding_size: int, num_classes: int,
                 in_channels: int) -> None:
        super().__init__()
        self.resnet = _HFResNetModel(block, depths, hidden_sizes, embedding_size, in_channels)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(hidden_sizes[-1], num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.resnet(x))


def hf_resnet_like(depths=(3, 4, 6, 3), *, layer_type: str = "bottleneck", width: int = 4, num_classes: int = 10,
                   in_channels: int = 3) -> nn.Module:
    """Hugging Face transformers' ``ResNetForImageClassification`` structure at a small width (returns logits).

    ``depths=(3, 4, 6, 3)`` with ``layer_type="bottleneck"`` is ResNet-50's
    layout: 16 ``ResNetBottleNeckLayer`` blocks of three convolutions and four
    ``ResNetShortCut`` convolutions, the 52 convolutions the default targets
    convert. ``layer_type="basic"`` gives ``ResNetBasicLayer`` blocks.
    """
    if layer_type not in ("bottleneck", "basic"):
        raise ValueError(f"layer_type must be 'bottleneck' or 'basic', but got layer_type={layer_type!r}")
    block = ResNetBottleNeckLayer if layer_type == "bottleneck" else ResNetBasicLayer
    mult = 4 if layer_type == "bottleneck" else 1
    hidden = [width * mult * 2**i for i in range(len(depths))]
    return _HFResNetForImageClassification(block, tuple(depths), hidden, width, num_classes, in_channels)


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's ``BatchNormAct2d`` (``timm.layers.norm_act``): a ``BatchNorm2d`` subclass whose own forward calls
    ``F.batch_norm`` with BatchNorm's running-statistics logic, then dropout and an activation."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 track_running_stats: bool = True, apply_act: bool = True, drop: float = 0.0) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats)
        self.drop = nn.Dropout(drop) if drop > 0 else nn.Identity()
        self.act = nn.SiLU(inplace=True) if apply_act else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        x = F.batch_norm(x, self.running_mean if not self.training or self.track_running_stats else None,
                         self.running_var if not self.training or self.track_running_stats else None,
                         self.weight, self.bias, bn_training, factor, self.eps)
        return self.act(self.drop(x))


class _TimmInvertedResidual(nn.Module):
    """timm's ``InvertedResidual`` (EfficientNet / MobileNetV3 blocks): conv -> BatchNormAct2d, three times."""

    def __init__(self, cin: int, cout: int, expand: int = 4, stride: int = 1) -> None:
        super().__init__()
        mid = cin * expand
        self.conv_pw = nn.Conv2d(cin, mid, 1, bias=False)
        self.bn1 = BatchNormAct2d(mid)
        self.conv_dw = nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False)
        self.bn2 = BatchNormAct2d(mid)
        self.conv_pwl = nn.Conv2d(mid, cout, 1, bias=False)
        self.bn3 = BatchNormAct2d(cout, apply_act=False)
        self.has_skip = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn3(self.conv_pwl(self.bn2(self.conv_dw(self.bn1(self.conv_pw(x))))))
        return out + x if self.has_skip else out


class _TimmMobileNetLike(nn.Module):
    def __init__(self, num_classes: int, in_channels: int, width: int) -> None:
        super().__init__()
        self.conv_stem = nn.Conv2d(in_channels, width, 3, 2, 1, bias=False)
        self.bn1 = BatchNormAct2d(width)
        self.blocks = nn.Sequential(_TimmInvertedResidual(width, width), _TimmInvertedResidual(width, 2 * width, 2))
        self.classifier = nn.Linear(2 * width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.blocks(self.bn1(self.conv_stem(x))).mean((2, 3)))


def timm_mobilenet_like(num_classes: int = 10, in_channels: int = 3, width: int = 8) -> nn.Module:
    """A small timm-style EfficientNet / MobileNet: every conv feeds a :class:`BatchNormAct2d` (7 convs)."""
    return _TimmMobileNetLike(num_classes, in_channels, width)
