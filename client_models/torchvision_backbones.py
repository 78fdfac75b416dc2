"""FedClassAvg's heterogeneous backbones (Jang et al., ICPP 2022, section 4.4).

ResNet-18, ShuffleNetV2 x1.0 and GoogLeNet come from torchvision without pre-training; the
first convolution is rebuilt for the input's channel count (1 for (F)MNIST) and the final FC
is dropped, so backbone + optional projection is the extractor and our Linear is the head.
``alexnet-small`` is the custom small AlexNet FedClassAvg uses for 28x28 / 32x32 inputs.

The torchvision networks have fixed widths: ``width != 1`` raises ModelConfigError
(they are also slow on CPU -- prefer the small ResNets there).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from .base import HeteroModel, ModelConfigError, finish_model, probe_output_shape, scale_channels

FAMILY = "fedclassavg"



def _tv():
    """``torchvision.models``, imported when a backbone is built (it costs seconds of start-up
    to every process that imports the zoo otherwise)."""
    from torchvision import models
    return models


# Constructors without pre-trained weights (no downloads, ever).
TORCHVISION_BACKBONES: dict[str, Callable[[], nn.Module]] = {
    "tv-resnet18": lambda: _tv().resnet18(weights=None),
    "tv-shufflenetv2": lambda: _tv().shufflenet_v2_x1_0(weights=None),
    "tv-googlenet": lambda: _tv().googlenet(weights=None, aux_logits=False, init_weights=True),
}

ALEXNET_SMALL_CHANNELS = (64, 128, 256)
ALEXNET_SMALL_FEATURES = 512  # FedClassAvg's common feature size (2304 -> 512 FC)


def build_torchvision_backbone(
    arch: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    feature_dim: int | None = None,
    width: float = 1.0,
) -> HeteroModel:
    """torchvision backbone; native representation = in_features of its replaced ``fc``."""
    if width != 1:
        raise ModelConfigError(
            f"width={width!r} is not allowed for {arch!r}: torchvision backbones have a fixed "
            "width; use width=1.0, or a 'resnetNN' architecture, which scales"
        )
    net = TORCHVISION_BACKBONES[arch]()
    _adapt_first_conv(net, input_shape[0])
    native = net.fc.in_features
    net.fc = nn.Identity()
    probe_output_shape(net, input_shape, arch)  # clear error for a too-small input
    return finish_model(arch, FAMILY, input_shape, net, native, num_classes, feature_dim)


def _adapt_first_conv(net: nn.Module, in_channels: int) -> None:
    """Replace the network's first Conv2d by one reading ``in_channels`` channels.

    Everything else (kernel, stride, padding, bias) is kept; the new conv gets PyTorch's
    default initialisation.
    """
    name, conv = next((n, m) for n, m in net.named_modules() if isinstance(m, nn.Conv2d))
    if conv.in_channels == in_channels:
        return
    parent_name, _, child_name = name.rpartition(".")
    new_conv = nn.Conv2d(
        in_channels,
        conv.out_channels,
        conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=conv.groups,
        bias=conv.bias is not None,
    )
    setattr(net.get_submodule(parent_name), child_name, new_conv)


def build_alexnet_small(
    arch: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    feature_dim: int | None = None,
    width: float = 1.0,
) -> HeteroModel:
    """FedClassAvg's small AlexNet (official ``models.alexnet_mnist``).

    conv 3x3 'same' 64 -> ReLU -> maxpool 2 stride 1 pad 1; conv 128 -> ReLU -> maxpool 2
    stride 2 pad 1; conv 256 -> ReLU; adaptive avg-pool 3x3; dropout 0.5; FC 2304 -> 512 -> ReLU.
    ``width`` scales the three conv layers; the 512-d representation stays (it is the size
    FedClassAvg's classifiers share).
    """
    c1, c2, c3 = (scale_channels(c, width) for c in ALEXNET_SMALL_CHANNELS)
    body = nn.Sequential(
        nn.Conv2d(input_shape[0], c1, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2, stride=1, padding=1),
        nn.Conv2d(c1, c2, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2, stride=2, padding=1),
        nn.Conv2d(c2, c3, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(3),
        nn.Flatten(),
        nn.Dropout(0.5),
        nn.Linear(c3 * 3 * 3, ALEXNET_SMALL_FEATURES),
        nn.ReLU(inplace=True),
    )
    probe_output_shape(body, input_shape, arch)
    return finish_model(
        arch, FAMILY, input_shape, body, ALEXNET_SMALL_FEATURES, num_classes, feature_dim
    )
