"""ResNet18 (He et al. 2016) with torchvision's module names, initialisation and forward pass.

Why not ``torchvision.models.resnet18``: importing torchvision imports ``torch._dynamo`` (through
``torchvision.ops``), about 1.5-3 s on the development machine, paid by every command that builds
the model, including each ``wsi-milssl heatmap`` run. This module builds the same network: the same
state-dict keys and shapes (torchvision and ImageNet ResNet18 checkpoints load as they are), the same
random initialisation for the same seed, and the same outputs; ``tests/mil/test_mil_resnet.py``
checks all three against torchvision.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ResNet18", "BasicBlock", "init_resnet_weights"]


def init_resnet_weights(model: nn.Module) -> None:
    """torchvision's ResNet initialisation, in module order: Kaiming-normal (fan out) convolutions,
    BatchNorm weight 1 and bias 0 (linear layers keep their default)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)


def _conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (a 1x1 projection when the
    shape changes)."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_planes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet18 for (B, 3, H, W) float input -> (B, num_classes) logits."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        widths = (64, 128, 256, 512)
        in_planes = 64
        for i, planes in enumerate(widths):
            stride = 1 if i == 0 else 2
            self.add_module(f"layer{i + 1}", nn.Sequential(BasicBlock(in_planes, planes, stride),
                                                           BasicBlock(planes, planes)))
            in_planes = planes
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        init_resnet_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
