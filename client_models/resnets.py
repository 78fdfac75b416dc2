"""Small CIFAR-style ResNets built from BasicBlocks, with configurable depth and width.

These are the CPU-sized stand-ins for the ResNets of Felo/Velo (Chan & Ngai, Computer Networks)
and FedClassAvg (Jang et al., ICPP 2022): a 3x3 stem without max-pool (so 28x28 and 32x32
inputs are not shrunk 4x before the first stage), four stages of BasicBlocks with widths
64-128-256-512 times ``width`` and strides 1-2-2-2, then global average pooling.
"""

from __future__ import annotations

from torch import nn

from .base import HeteroModel, finish_model, probe_output_shape, scale_channels

FAMILY = "resnet"

STAGE_WIDTHS = (64, 128, 256, 512)
STAGE_STRIDES = (1, 2, 2, 2)

# BasicBlocks per stage; depth = 2 convs per block + stem + head.
RESNET_STAGE_BLOCKS: dict[str, tuple[int, int, int, int]] = {
    "resnet10": (1, 1, 1, 1),
    "resnet14": (1, 1, 2, 2),
    "resnet18": (2, 2, 2, 2),
    "resnet22": (2, 3, 3, 2),
    "resnet26": (3, 3, 3, 3),
}


def build_cifar_resnet(
    arch: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    feature_dim: int | None = None,
    width: float = 1.0,
) -> HeteroModel:
    """CIFAR-style ResNet; native representation = the last stage's channels (512 * width)."""
    widths = [scale_channels(w, width) for w in STAGE_WIDTHS]
    layers: list[nn.Module] = [
        nn.Conv2d(input_shape[0], widths[0], 3, stride=1, padding=1, bias=False),
        nn.BatchNorm2d(widths[0]),
        nn.ReLU(inplace=True),
    ]
    in_channels = widths[0]
    for out_channels, blocks, stride in zip(widths, RESNET_STAGE_BLOCKS[arch], STAGE_STRIDES):
        layers.append(residual_stage("BasicBlock", in_channels, out_channels, blocks, stride))
        in_channels = out_channels
    layers.append(nn.AdaptiveAvgPool2d(1))
    body = nn.Sequential(*layers)
    probe_output_shape(body, input_shape, arch)  # clear error for a too-small input
    return finish_model(arch, FAMILY, input_shape, body, widths[-1], num_classes, feature_dim)


def residual_stage(block: str, in_channels: int, planes: int, blocks: int,
                   stride: int) -> nn.Sequential:
    """``blocks`` of torchvision's ``block`` ("BasicBlock", or "Bottleneck": 4 x planes out),
    the first one changing resolution or width through a 1x1 shortcut, as ResNet's
    ``_make_layer``."""
    # Imported here: torchvision costs seconds of start-up to every process that imports the zoo.
    from torchvision.models import resnet
    kind = getattr(resnet, block)
    out_channels = planes * kind.expansion
    stage = []
    for i in range(blocks):
        block_stride = stride if i == 0 else 1
        shortcut = None
        if block_stride != 1 or in_channels != out_channels:
            shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=block_stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        stage.append(kind(in_channels, planes, stride=block_stride, downsample=shortcut))
        in_channels = out_channels
    return nn.Sequential(*stage)
