"""FedGKT's split models (He, Annavaram, Avestimehr, NeurIPS 2020): a client's stem, whose
feature map is uploaded, and the server's large model that takes that map as its input.

FedGKT cuts each client model after its stem: the stem's output ``H = stem(x)`` travels to the
server for every training sample, and one server model consumes every client's maps, so every
client's stem must emit the same ``(channels, height, width)``. The rest of the client model
(everything after the stem, head included) is the client's own small classifier path.

Two families are defined here, after the reference code's ``resnet56_gkt`` models:

* ``gkt-resnet5`` / ``gkt-resnet8`` / ``gkt-resnet11`` (family ``gkt``), the client's
  "ResNet-8" and its shallower and deeper siblings: a 3x3 stem conv (16 channels) + BN + ReLU,
  whose map is uploaded (16x28x28 for Fashion-MNIST), then 1, 2 or 3 Bottleneck blocks of 16
  planes (64 channels out), global average pooling and the head. Every member has the same
  stem, so any mix of them satisfies FedGKT's constraint; they differ in the classifier path.
* ``gkt-server-resnet20`` / ``gkt-server-resnet56`` (family ``gkt-server``): a Bottleneck
  ResNet with three stages of 2 or 6 blocks (planes 16-32-64, 64-128-256 channels out, strides
  1-2-2) and no stem: its input is the clients' map. ``-resnet56`` is the reference's server
  ([6, 6, 6]); ``-resnet20`` is a CPU-sized stand-in with the same layout.

``model-width`` scales every width, the stem's included (so the map's channels too). Where
each family's stem ends, and the check that a mix's stems agree: ``client_models.stems``.
"""

from __future__ import annotations

from torch import nn

from .base import HeteroModel, finish_model, probe_output_shape, scale_channels
from .resnets import residual_stage

CLIENT_FAMILY = "gkt"
SERVER_FAMILY = "gkt-server"

GKT_STEM_CHANNELS = 16
GKT_PLANES = (16, 32, 64)  # Bottleneck planes per stage; each block outputs 4x as many

# Client models: Bottleneck blocks after the stem (depth = stem + 3 convs a block + head).
GKT_CLIENT_BLOCKS: dict[str, int] = {"gkt-resnet5": 1, "gkt-resnet8": 2, "gkt-resnet11": 3}
# Server models: Bottleneck blocks per stage (depth = 9 x blocks + 2, as the reference names
# its ResNet-56 server, whose own stem is never used).
GKT_SERVER_BLOCKS: dict[str, int] = {"gkt-server-resnet20": 2, "gkt-server-resnet56": 6}

def build_gkt_client(arch: str, input_shape: tuple[int, int, int], num_classes: int,
                     feature_dim: int | None = None, width: float = 1.0) -> HeteroModel:
    """A FedGKT client model: stem (uploaded map), ``GKT_CLIENT_BLOCKS[arch]`` Bottleneck
    blocks, average pooling; native representation 64 x width."""
    stem = scale_channels(GKT_STEM_CHANNELS, width)
    planes = scale_channels(GKT_PLANES[0], width)
    layers: list[nn.Module] = [
        nn.Conv2d(input_shape[0], stem, 3, stride=1, padding=1, bias=False),
        nn.BatchNorm2d(stem),
        nn.ReLU(inplace=True),
        residual_stage("Bottleneck", stem, planes, GKT_CLIENT_BLOCKS[arch], stride=1),
        nn.AdaptiveAvgPool2d(1),
    ]
    body = nn.Sequential(*layers)
    probe_output_shape(body, input_shape, arch)
    return finish_model(arch, CLIENT_FAMILY, input_shape, body, planes * 4, num_classes,
                        feature_dim)


def build_gkt_server(arch: str, input_shape: tuple[int, int, int], num_classes: int,
                     feature_dim: int | None = None, width: float = 1.0) -> HeteroModel:
    """A FedGKT server model on maps of ``input_shape`` (the clients' stem output): three
    Bottleneck stages, no stem; native representation 256 x width."""
    in_channels = input_shape[0]
    stages = []
    for i, planes in enumerate(GKT_PLANES):
        planes = scale_channels(planes, width)
        stages.append(residual_stage("Bottleneck", in_channels, planes,
                                     GKT_SERVER_BLOCKS[arch], stride=1 if i == 0 else 2))
        in_channels = planes * 4
    body = nn.Sequential(*stages, nn.AdaptiveAvgPool2d(1))
    probe_output_shape(body, input_shape, arch)
    return finish_model(arch, SERVER_FAMILY, input_shape, body, in_channels, num_classes,
                        feature_dim)
