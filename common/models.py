"""Models the phases train, from a 5k-parameter MLP to ViT-L/16, behind `build_model`.

`build_model(name, in_shape, num_classes, seed)` initialises deterministically: the same
arguments give bit-identical parameters in every process. That is what lets each rank
build its own replica and still start in sync (and lets tests check that a broadcast
really happened: SmallCNN has BatchNorm buffers, MLP has none).
"""

from __future__ import annotations

import math

import torch
from torch import nn

MODEL_NAMES = ("mlp", "cnn", "resnet18", "resnet50", "vit_b_16", "vit_l_16")


class MLP(nn.Module):
    """Flatten -> [Linear -> ReLU] per hidden width -> Linear.

    (B, *) with prod(*) == in_features -> logits (B, num_classes). Parameters only, no buffers.
    """

    def __init__(self, in_features: int, num_classes: int = 10, hidden: tuple[int, ...] = (64,)):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        for width in hidden:
            layers += [nn.Linear(in_features, width), nn.ReLU()]
            in_features = width
        layers.append(nn.Linear(in_features, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Two conv3x3-BatchNorm-ReLU blocks (width, then 2*width channels), global pool, Linear.

    (B, in_channels, H, W) -> logits (B, num_classes) for any H, W (8x8 digits, 32x32 CIFAR).
    The BatchNorm running statistics are buffers, not parameters: DDP must broadcast them.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16):
        super().__init__()
        # bias=False: the BatchNorm right after subtracts the mean, cancelling any bias.
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def cifar_resnet18(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """torchvision ResNet-18 with the CIFAR stem: (B, in_channels, 32, 32) -> (B, num_classes).

    The ImageNet stem (7x7 stride-2 conv, then max-pool) shrinks 32x32 to 8x8 before the
    first block; a 3x3 stride-1 conv and no pool keep the resolution small images need.
    """
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def _build(name: str, in_shape: tuple, num_classes: int) -> nn.Module:
    channels, width = in_shape[0], in_shape[-1]
    if name == "mlp":
        return MLP(math.prod(in_shape), num_classes)
    if name == "cnn":
        return SmallCNN(channels, num_classes)
    if name == "resnet18" and width <= 64:
        return cifar_resnet18(num_classes, in_channels=channels)

    import torchvision.models as tvm  # a second to import; only the big models need it

    if channels != 3:
        raise ValueError(f"model {name!r} at this size takes 3-channel images, got in_shape {tuple(in_shape)}")
    if name == "resnet18":
        return tvm.resnet18(weights=None, num_classes=num_classes)
    if name == "resnet50":
        return tvm.resnet50(weights=None, num_classes=num_classes)
    if width % 16 != 0 or in_shape[-2] != width:
        raise ValueError(f"{name} needs square images with a side divisible by 16, got in_shape {tuple(in_shape)}")
    return getattr(tvm, name)(weights=None, image_size=width, num_classes=num_classes)  # vit_b_16, vit_l_16


def build_model(name: str, in_shape: tuple = (1, 8, 8), num_classes: int = 10, seed: int = 0) -> nn.Module:
    """Model `name` (one of MODEL_NAMES) for inputs (B, *in_shape), on CPU, in train mode.

    Parameters depend only on (name, in_shape, num_classes, seed): every process that
    calls this with the same arguments gets bit-identical weights. The caller's global
    RNG state is left exactly as it was.
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)}")
    # fork_rng restores the CPU RNG on exit; devices=[] because we build on CPU and
    # forking CUDA RNGs would initialise CUDA (and warn) for nothing.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _build(name, tuple(in_shape), num_classes)
