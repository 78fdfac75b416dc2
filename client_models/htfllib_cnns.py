"""HtFLlib's 1-channel CNN family ("HCNNs8"): the peer's models, for cross-checking against it.

HtFLlib (TsingZ0/HtFLlib) builds these eight models from its class ``CNN`` in
``system/flcore/trainmodel/models.py``; its ``main.py`` listed them as the model family
``HCNNs8`` until commit 3fb1596 (the class is still there at e959261):
``CNN(num_cov=..., hidden_dims=[...], in_features=1, num_classes=...)`` with ``num_cov`` in
{1, 2} and ``hidden_dims`` in {[], [512], [1024], [1024, 512]}, model k of the family given to
client k mod 8. Written here from those layer lists (no code copied):

- ``num_cov`` convolutions, 5x5, no padding, each followed by ReLU and a 2x2 max-pool: the
  first 1 -> 32 channels, the second 32 -> 64;
- flatten, then a Linear + ReLU per entry of ``hidden_dims`` and a last Linear + ReLU to the
  feature dimension (512 in HtFLlib, its ``feature_dim``): that ReLU output is the
  representation z (HtFLlib's ``BaseHeadSplit`` replaces the model's ``fc`` with an identity
  pooling to ``feature_dim``);
- head ``Linear(512, C)``.

Names say where they come from: ``htfllib-cnn-c{num_cov}`` plus ``-{hidden dims}``.
``feature_dim`` sets the last Linear's size directly, as HtFLlib's ``feature_dim`` does;
``width`` scales the conv channels (1.0 = HtFLlib's).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .base import HeteroModel, flatten_dim, scale_channels

FAMILY = "htfllib-cnn"
HTFLLIB_FEATURE_DIM = 512
HTFLLIB_CONV_CHANNELS = (32, 64)


@dataclass(frozen=True)
class HtFLlibCNNSpec:
    num_cov: int
    hidden_dims: tuple[int, ...]


def _name(spec: HtFLlibCNNSpec) -> str:
    return "htfllib-cnn-c" + str(spec.num_cov) + "".join(f"-{h}" for h in spec.hidden_dims)


# HCNNs8's order: client k gets model k mod 8 there, and `arch-mix` keeps this order.
HCNNS8 = [HtFLlibCNNSpec(num_cov, hidden)
          for hidden in [(), (512,), (1024,), (1024, 512)] for num_cov in (1, 2)]
HTFLLIB_CNNS: dict[str, HtFLlibCNNSpec] = {_name(spec): spec for spec in HCNNS8}


def build_htfllib_cnn(
    arch: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    feature_dim: int | None = None,
    width: float = 1.0,
) -> HeteroModel:
    """[conv5x5 -> ReLU -> max-pool 2] x num_cov -> [Linear -> ReLU] per hidden dim and to d."""
    spec = HTFLLIB_CNNS[arch]
    layers: list[nn.Module] = []
    channels = input_shape[0]
    for out in HTFLLIB_CONV_CHANNELS[:spec.num_cov]:
        out = scale_channels(out, width)
        layers += [nn.Conv2d(channels, out, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        channels = out
    convs = nn.Sequential(*layers)
    d = HTFLLIB_FEATURE_DIM if feature_dim is None else feature_dim
    fcs: list[nn.Module] = [nn.Flatten()]
    size = flatten_dim(convs, input_shape, arch)
    for units in (*spec.hidden_dims, d):
        fcs += [nn.Linear(size, units), nn.ReLU(inplace=True)]
        size = units
    return HeteroModel(arch, FAMILY, input_shape, nn.Sequential(convs, *fcs), d, num_classes)
