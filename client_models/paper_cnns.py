"""The small CNNs the papers themselves use for heterogeneous clients.

* FedGH CNN-1..5 (Yi et al., ACM MM 2023, Table 2; official ``Models/CNNs.py``).
* FedHe / FedMD CNN 0..9 (Chan & Ngai, MSN 2021, Table II; official TF ``Model.py``).

Both families are plain stacks of convolutions; only the layer sizes in the tables differ
between the members, so each family is one spec table plus one builder.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from .base import HeteroModel, finish_model, flatten_dim, scale_channels

FEDGH_FAMILY = "fedgh-cnn"
FEDHE_FAMILY = "fedhe-cnn"

# ----------------------------------------------------------------------------------------
# FedGH CNN-1..5
# ----------------------------------------------------------------------------------------

# conv1 has 16 filters in all five models; the representation is the 500-d fc2 output.
FEDGH_CONV1_CHANNELS = 16
FEDGH_REPRESENTATION_DIM = 500
FEDGH_KERNEL = 5


@dataclass(frozen=True)
class FedGHSpec:
    """One column of FedGH Table 2."""

    conv2_channels: int
    fc1_units: int
    paper_size_mb: float  # "model size" printed in Table 2 (3x32x32 input, C = 10)


FEDGH_CNNS: dict[str, FedGHSpec] = {
    "cnn1": FedGHSpec(conv2_channels=32, fc1_units=2000, paper_size_mb=10.00),
    "cnn2": FedGHSpec(conv2_channels=16, fc1_units=2000, paper_size_mb=6.92),
    "cnn3": FedGHSpec(conv2_channels=32, fc1_units=1000, paper_size_mb=5.04),
    "cnn4": FedGHSpec(conv2_channels=32, fc1_units=800, paper_size_mb=3.81),
    "cnn5": FedGHSpec(conv2_channels=32, fc1_units=500, paper_size_mb=2.55),
}


def build_fedgh_cnn(
    arch: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    feature_dim: int | None = None,
    width: float = 1.0,
) -> HeteroModel:
    """FedGH CNN-k: [conv5x5 -> ReLU -> maxpool2] x 2 -> fc1 -> ReLU -> fc2 -> ReLU | head fc3.

    fc2 is the paper's representation layer, so ``feature_dim`` sets fc2's size directly
    (default 500) instead of adding a projection.  ``width`` scales both conv layers and fc1.
    """
    spec = FEDGH_CNNS[arch]
    conv1 = scale_channels(FEDGH_CONV1_CHANNELS, width)
    conv2 = scale_channels(spec.conv2_channels, width)
    fc1 = scale_channels(spec.fc1_units, width)
    d = FEDGH_REPRESENTATION_DIM if feature_dim is None else feature_dim

    convs = nn.Sequential(
        *_conv_relu_maxpool(input_shape[0], conv1),
        *_conv_relu_maxpool(conv1, conv2),
    )
    # conv2 * 5 * 5 for 32x32 inputs (the paper's CIFAR setting), conv2 * 4 * 4 for 28x28.
    flat = flatten_dim(convs, input_shape, arch)
    extractor = nn.Sequential(
        convs,
        nn.Flatten(),
        nn.Linear(flat, fc1),
        nn.ReLU(inplace=True),
        nn.Linear(fc1, d),
        nn.ReLU(inplace=True),  # the representation is post-ReLU fc2 (official code)
    )
    return HeteroModel(arch, FEDGH_FAMILY, input_shape, extractor, d, num_classes)


def _conv_relu_maxpool(in_channels: int, out_channels: int) -> list[nn.Module]:
    # 'valid' 5x5 convolution, as in the official code (no padding argument).
    return [
        nn.Conv2d(in_channels, out_channels, FEDGH_KERNEL),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2, 2),
    ]


# ----------------------------------------------------------------------------------------
# FedHe / FedMD CNN 0..9
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FedHeSpec:
    """One row of FedHe Table II: the conv filter counts (2 or 3 layers) and the dropout rate."""

    filters: tuple[int, ...]
    dropout: float


FEDHE_CNNS: dict[str, FedHeSpec] = {
    "fedhe-cnn0": FedHeSpec((128, 256), 0.2),
    "fedhe-cnn1": FedHeSpec((128, 384), 0.2),
    "fedhe-cnn2": FedHeSpec((128, 512), 0.2),
    "fedhe-cnn3": FedHeSpec((256, 256), 0.3),
    "fedhe-cnn4": FedHeSpec((256, 512), 0.4),
    "fedhe-cnn5": FedHeSpec((64, 128, 256), 0.2),
    "fedhe-cnn6": FedHeSpec((64, 128, 192), 0.2),
    "fedhe-cnn7": FedHeSpec((128, 192, 256), 0.2),
    "fedhe-cnn8": FedHeSpec((128, 128, 128), 0.3),
    # Table II prints 198 for the 3rd conv; the official code uses 192, and the paper's own
    # parameter count for model 9 (324,672 on MNIST) only works out with 192.
    "fedhe-cnn9": FedHeSpec((128, 128, 192), 0.3),
}


class KerasSameAvgPool2x2(nn.Module):
    """Keras ``AveragePooling2D((2, 2), strides=1, padding='same')``: keeps H x W.

    TensorFlow puts the one missing row/column of padding at the bottom/right and averages
    only real pixels there.  PyTorch pads symmetrically, so pool with padding 1 on every side
    (excluding the padding from the mean) and drop the first output row and column.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AvgPool2d(2, stride=1, padding=1, count_include_pad=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.pool(x)[:, :, 1:, 1:]


def build_fedhe_cnn(
    arch: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    feature_dim: int | None = None,
    width: float = 1.0,
) -> HeteroModel:
    """FedHe/FedMD CNN: conv blocks (conv -> BN -> ReLU -> dropout) then flatten | dense head.

    Layer layout from FedHe's official ``Model.py`` (Chan & Ngai, MSN 2021):
      conv1 3x3 'same' -> avg-pool 2x2 stride 1 'same';
      2-layer models: conv2 3x3 stride 2 'valid';
      3-layer models: conv2 2x2 stride 2 'valid' -> avg-pool 2x2 stride 2
                      -> conv3 3x3 stride 2 'valid'.
    The native representation is the flattened last conv block.  ``width`` scales the
    filter counts (full width is far too slow on CPU; use about 0.25).
    The official head is a bias-free Dense with L2 1e-3; here it is a normal Linear like
    every other family, so heads are interchangeable.
    """
    spec = FEDHE_CNNS[arch]
    filters = [scale_channels(f, width) for f in spec.filters]
    p = spec.dropout

    layers = _conv_bn_relu_dropout(input_shape[0], filters[0], 3, 1, 1, p)  # 'same' for 3x3
    layers.append(KerasSameAvgPool2x2())
    if len(filters) == 2:
        layers += _conv_bn_relu_dropout(filters[0], filters[1], 3, 2, 0, p)
    else:
        layers += _conv_bn_relu_dropout(filters[0], filters[1], 2, 2, 0, p)
        layers.append(nn.AvgPool2d(2, 2))
        layers += _conv_bn_relu_dropout(filters[1], filters[2], 3, 2, 0, p)
    body = nn.Sequential(*layers)
    native = flatten_dim(body, input_shape, arch)
    return finish_model(arch, FEDHE_FAMILY, input_shape, body, native, num_classes, feature_dim)


def _conv_bn_relu_dropout(
    in_channels: int, out_channels: int, kernel: int, stride: int, padding: int, dropout: float
) -> list[nn.Module]:
    # Keras' BatchNormalization defaults differ (momentum 0.99 = PyTorch 0.01, eps 1e-3);
    # PyTorch's defaults are kept so running statistics follow the few local steps of FL.
    return [
        nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=padding),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
    ]
