"""torchvision's ResNet-50 layout without torchvision (benchmarks only): 52 block convolutions when converted."""
from __future__ import annotations

from typing import List

from torch import nn

__all__ = ["Bottleneck", "ResNet50", "resnet50"]


class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck (v1.5: stride on the 3x3 conv)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != planes * 4:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(planes * 4))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet50(nn.Sequential):
    """The layers in order, as ``nn.Sequential`` (its state_dict names), with a ``forward`` of its own: a model
    class like torchvision's. ``torch.compile`` runs a user-defined module's hooks outside the compiled frame (the
    fold coordinator's among them); a bare ``nn.Sequential`` root has them traced inside it (torch 2.13 resumes
    after the coordinator's graph break; torch 2.11 compiled the bottlenecks one by one instead)."""

    def forward(self, x):
        for layer in self:
            x = layer(x)
        return x


def resnet50(width: int = 64, num_classes: int = 1000) -> nn.Module:
    """torchvision's ResNet-50 layout ([3, 4, 6, 3] bottlenecks) without torchvision."""
    layers: List[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    inplanes = width
    for i, blocks in enumerate((3, 4, 6, 3)):
        planes = width * 2**i
        for b in range(blocks):
            layers.append(Bottleneck(inplanes, planes, stride=2 if (b == 0 and i > 0) else 1))
            inplanes = planes * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inplanes, num_classes)]
    return ResNet50(*layers)
