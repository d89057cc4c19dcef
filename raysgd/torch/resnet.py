"""CIFAR-sized ResNets (``ResNet18`` ... ``ResNet152``), as RaySGD 1.x's CIFAR example used them.

Outside the training layers: imports torch only. torchvision is not needed. These are the
CIFAR variants of He et al. (2016): a 3x3 stem without max-pooling (32x32 inputs keep their
resolution into the first stage), four stages of 64/128/256/512 channels, global average pooling
and one linear layer. As in 1.x, each constructor takes the trainer ``config`` (it reads
``num_classes``, default 10).

Example:
    >>> import torch
    >>> model = ResNet18({"num_classes": 10})
    >>> model(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""
from typing import TYPE_CHECKING

import torch.nn as nn
import torch.nn.functional as F

from raysgd.base.checks import expect, is_int

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "ResNet18", "ResNet34", "ResNet50", "ResNet101", "ResNet152"]


def _conv3x3(in_planes, planes, stride=1):
    return nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)


def _shortcut(in_planes, planes, stride):
    """Identity when shapes match, else a 1x1 projection and batch norm (option B of the paper)."""
    if stride == 1 and in_planes == planes:
        return nn.Sequential()
    return nn.Sequential(nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False),
                         nn.BatchNorm2d(planes))


# Parameter names (conv1, bn1, ..., shortcut.0, layer1..layer4, linear) are those of RaySGD 1.x's
# models, so a state dict saved with ray.util.sgd.torch.resnet loads here unchanged.
class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a residual connection (ResNet18/34).

    Example:
        >>> import torch
        >>> BasicBlock(64, 128, stride=2)(torch.zeros(1, 64, 8, 8)).shape
        torch.Size([1, 128, 4, 4])
    """

    expansion = 1

    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.conv1 = _conv3x3(in_planes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = _shortcut(in_planes, planes * self.expansion, stride)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4) and a residual connection (ResNet50/101/152).

    Example:
        >>> import torch
        >>> Bottleneck(64, 64)(torch.zeros(1, 64, 8, 8)).shape
        torch.Size([1, 256, 8, 8])
    """

    expansion = 4

    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)  # the stride sits on the 3x3, as in 1.x
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.shortcut = _shortcut(in_planes, planes * self.expansion, stride)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR ResNet from a block type and the number of blocks in each of the four stages.

    Args:
        block: :class:`BasicBlock` or :class:`Bottleneck`.
        num_blocks: four ints, e.g. ``[2, 2, 2, 2]`` for ResNet18.
        num_classes: size of the output layer.
        in_channels: channels of the input images (3 for CIFAR).

    Example:
        >>> import torch
        >>> tiny = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=4)
        >>> tiny(torch.zeros(1, 3, 16, 16)).shape
        torch.Size([1, 4])
    """

    if TYPE_CHECKING:  # the four stages, set in __init__ by setattr
        layer1: nn.Sequential
        layer2: nn.Sequential
        layer3: nn.Sequential
        layer4: nn.Sequential

    def __init__(self, block, num_blocks, num_classes=10, in_channels=3):
        super().__init__()
        how = {"caller": "ResNet", "call": True}
        expect(isinstance(num_blocks, (list, tuple)) and len(num_blocks) == 4 and all(is_int(n, 1) for n in num_blocks),
               "num_blocks", "four ints >= 1", num_blocks, **how)
        expect(is_int(num_classes, 1), "num_classes", "an int >= 1", num_classes, **how)
        expect(is_int(in_channels, 1), "in_channels", "an int >= 1", in_channels, **how)
        num_blocks, num_classes = [int(n) for n in num_blocks], int(num_classes)  # numpy's (labels.max() + 1): Python's
        self.conv1 = _conv3x3(in_channels, 64)  # no stride, no max-pool: 32x32 inputs stay 32x32
        self.bn1 = nn.BatchNorm2d(64)
        in_planes = 64
        for index, (planes, blocks) in enumerate(zip((64, 128, 256, 512), num_blocks)):
            layers = []
            for i in range(blocks):
                layers.append(block(in_planes, planes, stride=2 if index > 0 and i == 0 else 1))
                in_planes = planes * block.expansion
            setattr(self, f"layer{index + 1}", nn.Sequential(*layers))
        self.linear = nn.Linear(in_planes, num_classes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)  # 4x4 -> 1x1 for 32x32 inputs
        return self.linear(out)


def _num_classes(config):
    if config is None:
        return 10
    if not isinstance(config, dict):
        raise TypeError(f"ResNet constructors take the trainer config (a dict) or None; got {config!r}")
    return config.get("num_classes", 10)


def ResNet18(config=None):  # noqa: N802 (the 1.x names)
    """ResNet18 for 32x32 images (about 11.2 M parameters with 10 classes).

    Example:
        >>> sum(p.numel() for p in ResNet18().parameters())
        11173962
    """
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=_num_classes(config))


def ResNet34(config=None):  # noqa: N802
    """ResNet34 for 32x32 images.

    Example:
        >>> model = ResNet34({"num_classes": 100})
    """
    return ResNet(BasicBlock, [3, 4, 6, 3], num_classes=_num_classes(config))


def ResNet50(config=None):  # noqa: N802
    """ResNet50 (bottleneck blocks) for 32x32 images.

    Example:
        >>> model = ResNet50()
    """
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes=_num_classes(config))


def ResNet101(config=None):  # noqa: N802
    """ResNet101 for 32x32 images.

    Example:
        >>> model = ResNet101()
    """
    return ResNet(Bottleneck, [3, 4, 23, 3], num_classes=_num_classes(config))


def ResNet152(config=None):  # noqa: N802
    """ResNet152 for 32x32 images.

    Example:
        >>> model = ResNet152()
    """
    return ResNet(Bottleneck, [3, 8, 36, 3], num_classes=_num_classes(config))
