"""ResNet50 (He et al. 2016) with torchvision's module names, initialisation and forward pass, and its
trunk after ``layer3`` as CLAM embeds patches (``resnet50_trunc``: 1024-d).

Why not ``torchvision.models.resnet50``: importing torchvision imports ``torch._dynamo`` (1.5-3 s on
the development machine) and torchvision is only a test dependency (see :mod:`wsi_milssl.mil.resnet`
for ResNet18). This module builds the same network: the same state-dict keys and shapes (torchvision,
timm ``resnet50.tv_in1k`` and CLAM's ImageNet ResNet50 checkpoints load as they are), the same random
initialisation for the same seed and the same outputs; ``tests/features/test_features_resnet.py``
checks them against torchvision.

``ResNet50(trunk=True)`` stops after ``layer3`` and average-pools its (B, 1024, H/16, W/16) output to
(B, 1024): the "truncated ResNet50" of CLAM (``resnet50_trunc``: timm ``resnet50.tv_in1k`` with
``features_only=True, out_indices=(3,)`` and ``AdaptiveAvgPool2d(1)``). It has no ``layer4`` and no
``fc``; loading a full ResNet50 state dict skips those keys.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Bottleneck", "ResNet50", "TRUNK_DIM"]

#: Width of the trunk's output (``layer3``'s channels).
TRUNK_DIM = 1024


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride here, as torchvision's "ResNet v1.5") -> 1x1 convolutions with BatchNorm and a
    residual connection (a 1x1 projection when the shape changes); output width ``planes * 4``."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_planes != out:
            self.downsample = nn.Sequential(nn.Conv2d(in_planes, out, kernel_size=1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet50(nn.Module):
    """ResNet50 for (B, 3, H, W) float input -> (B, num_classes) logits; with ``trunk=True`` the
    average-pooled ``layer3`` features float (B, 1024) instead (no ``layer4``, no ``fc``)."""

    def __init__(self, num_classes: int = 1000, *, trunk: bool = False) -> None:
        super().__init__()
        self.trunk = bool(trunk)
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        stages = ((64, 3), (128, 4), (256, 6)) + (() if self.trunk else ((512, 3),))
        in_planes = 64
        for i, (planes, blocks) in enumerate(stages):
            stride = 1 if i == 0 else 2
            layers = [Bottleneck(in_planes, planes, stride)]
            in_planes = planes * Bottleneck.expansion
            layers += [Bottleneck(in_planes, planes) for _ in range(1, blocks)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = None if self.trunk else nn.Linear(in_planes, num_classes)
        #: width of the output: 1024 for the trunk, ``num_classes`` otherwise
        self.out_features = in_planes if self.trunk else int(num_classes)
        from wsi_milssl.mil.resnet import init_resnet_weights  # here: importing wsi_milssl.mil costs ~0.1 s

        init_resnet_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer3(self.layer2(self.layer1(x)))
        if self.fc is None:
            return torch.flatten(self.avgpool(x), 1)
        x = self.layer4(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))
