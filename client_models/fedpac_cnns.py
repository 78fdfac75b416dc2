"""FedPAC's Fashion-MNIST CNN and a three-conv version: CompFL's two FMNIST experts.

CompFL (Xu et al., FedKDD 2024) trains two CNNs "with different numbers of conv-pool / FC layers" on
Fashion-MNIST without giving them. The same author's FedPAC code has ``CNN_FMNIST``
(conv 1->16 5x5, max-pool, conv 16->32 5x5 padding 1, max-pool, FC 800 -> 128, leaky ReLU,
head 128 -> C), the natural small expert, and a CIFAR CNN that adds a third conv
(32 -> 64 3x3 padding 1). ``fedpac-cnn3`` is CNN_FMNIST with that third conv; at 28x28 it is
not followed by a third max-pool (FedPAC's CIFAR CNN has one), because pooling the 5x5 map to
2x2 would leave a model with fewer parameters than the small expert (65k vs 116k), and CompFL
orders its experts by size. Without it the large expert has about twice the parameters
(237k) and twice the multiply-adds.

The representation is post-ReLU rather than FedPAC's post-leaky-ReLU, so that, as in every
family of the zoo, representations are non-negative (FedGH's post-ReLU fc2); the conv stack
keeps FedPAC's leaky ReLUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .base import HeteroModel, flatten_dim, scale_channels

FAMILY = "fedpac-cnn"
FEDPAC_REPRESENTATION_DIM = 128


@dataclass(frozen=True)
class FedPACSpec:
    """The conv stack: (out channels, kernel, padding, max-pool after) per conv."""

    convs: tuple[tuple[int, int, int, bool], ...]


FEDPAC_CNNS: dict[str, FedPACSpec] = {
    "fedpac-cnn": FedPACSpec(((16, 5, 0, True), (32, 5, 1, True))),
    "fedpac-cnn3": FedPACSpec(((16, 5, 0, True), (32, 5, 1, True), (64, 3, 1, False))),
}


def build_fedpac_cnn(
    arch: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    feature_dim: int | None = None,
    width: float = 1.0,
) -> HeteroModel:
    """[conv -> leaky ReLU (-> max-pool 2)] per conv -> FC -> ReLU | head Linear(d, C).

    The FC layer is the representation, so ``feature_dim`` sets its size directly (default
    128, FedPAC's); ``width`` scales the conv channels.
    """
    layers: list[nn.Module] = []
    channels = input_shape[0]
    for out, kernel, padding, pool in FEDPAC_CNNS[arch].convs:
        out = scale_channels(out, width)
        layers += [nn.Conv2d(channels, out, kernel, padding=padding), nn.LeakyReLU()]
        if pool:
            layers.append(nn.MaxPool2d(2, 2))
        channels = out
    convs = nn.Sequential(*layers)
    d = FEDPAC_REPRESENTATION_DIM if feature_dim is None else feature_dim
    extractor = nn.Sequential(convs, nn.Flatten(),
                              nn.Linear(flatten_dim(convs, input_shape, arch), d),
                              nn.ReLU(inplace=True))
    return HeteroModel(arch, FAMILY, input_shape, extractor, d, num_classes)
