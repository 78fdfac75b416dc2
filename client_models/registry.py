"""Architecture registry: build any client model by name, and assign architectures to clients.

Every family module contributes a spec table (name -> layer sizes) and one builder; this file
turns those tables into ``ARCHITECTURES`` so adding an architecture is one table row.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np

from .base import HeteroModel, ModelConfigError, check_common_args
from .custom import build_custom, is_import_path
from .paper_cnns import (
    FEDGH_CNNS,
    FEDGH_FAMILY,
    FEDHE_CNNS,
    FEDHE_FAMILY,
    build_fedgh_cnn,
    build_fedhe_cnn,
)
from .fedpac_cnns import FAMILY as FEDPAC_FAMILY
from .fedpac_cnns import FEDPAC_CNNS, build_fedpac_cnn
from .gkt import (CLIENT_FAMILY as GKT_FAMILY, GKT_CLIENT_BLOCKS, GKT_SERVER_BLOCKS,
                  SERVER_FAMILY as GKT_SERVER_FAMILY, build_gkt_client, build_gkt_server)
from .htfllib_cnns import FAMILY as HTFLLIB_FAMILY
from .htfllib_cnns import (HTFLLIB_CNNS, HTFLLIB_CONV_CHANNELS, HTFLLIB_FEATURE_DIM,
                           build_htfllib_cnn)
from .resnets import FAMILY as RESNET_FAMILY
from .resnets import RESNET_STAGE_BLOCKS, build_cifar_resnet
from .torchvision_backbones import FAMILY as FEDCLASSAVG_FAMILY
from .torchvision_backbones import (
    TORCHVISION_BACKBONES,
    build_alexnet_small,
    build_torchvision_backbone,
)

# builder(input_shape, num_classes, feature_dim, width) -> HeteroModel; build_model
# validates the arguments before calling it.
Builder = Callable[..., HeteroModel]


@dataclass(frozen=True)
class ArchInfo:
    """One registered architecture."""

    name: str
    family: str
    description: str
    builder: Builder


def _registry() -> dict[str, ArchInfo]:
    archs: list[ArchInfo] = []
    for name, spec in FEDGH_CNNS.items():
        archs.append(ArchInfo(
            name, FEDGH_FAMILY,
            f"FedGH Table 2 {name.upper()}: conv5x5 16, conv5x5 {spec.conv2_channels}, "
            f"fc1 {spec.fc1_units}, fc2 500 = representation",
            partial(build_fedgh_cnn, name),
        ))
    for name, spec in FEDHE_CNNS.items():
        archs.append(ArchInfo(
            name, FEDHE_FAMILY,
            f"FedHe/FedMD Table II model {name[-1]}: {len(spec.filters)} convs "
            f"{'-'.join(map(str, spec.filters))}, BN, dropout {spec.dropout}",
            partial(build_fedhe_cnn, name),
        ))
    for name, spec in FEDPAC_CNNS.items():
        archs.append(ArchInfo(
            name, FEDPAC_FAMILY,
            f"FedPAC CNN_FMNIST family (CompFL experts): {len(spec.convs)} convs "
            f"{'-'.join(str(c[0]) for c in spec.convs)}, FC 128 = representation, leaky ReLU",
            partial(build_fedpac_cnn, name),
        ))
    for name, spec in HTFLLIB_CNNS.items():
        archs.append(ArchInfo(
            name, HTFLLIB_FAMILY,
            f"HtFLlib's HCNNs8 CNN(num_cov={spec.num_cov}, hidden_dims={list(spec.hidden_dims)}):"
            f" conv5x5 {'-'.join(map(str, HTFLLIB_CONV_CHANNELS[:spec.num_cov]))}, FC "
            f"{'-'.join(map(str, spec.hidden_dims + (HTFLLIB_FEATURE_DIM,)))} = representation",
            partial(build_htfllib_cnn, name),
        ))
    for name, blocks in RESNET_STAGE_BLOCKS.items():
        archs.append(ArchInfo(
            name, RESNET_FAMILY,
            f"CIFAR-style ResNet, BasicBlocks per stage {list(blocks)}, "
            "widths 64-128-256-512 x width",
            partial(build_cifar_resnet, name),
        ))
    for name, blocks in GKT_CLIENT_BLOCKS.items():
        archs.append(ArchInfo(
            name, GKT_FAMILY,
            f"FedGKT client: stem conv3x3 16 + BN + ReLU (the uploaded map), {blocks} "
            "Bottleneck block(s) of 16 planes (64 out), average pooling",
            partial(build_gkt_client, name),
        ))
    for name, blocks in GKT_SERVER_BLOCKS.items():
        archs.append(ArchInfo(
            name, GKT_SERVER_FAMILY,
            f"FedGKT server: Bottleneck ResNet [{blocks}, {blocks}, {blocks}], planes 16-32-64, "
            "no stem (its input is the clients' stem map)",
            partial(build_gkt_server, name),
        ))
    for name in TORCHVISION_BACKBONES:
        archs.append(ArchInfo(
            name, FEDCLASSAVG_FAMILY,
            f"torchvision {name[3:]} (no pre-training), first conv adapted, fc removed",
            partial(build_torchvision_backbone, name),
        ))
    archs.append(ArchInfo(
        "alexnet-small", FEDCLASSAVG_FAMILY,
        "FedClassAvg small AlexNet: conv 64-128-256, avg-pool 3x3, FC 2304 -> 512",
        partial(build_alexnet_small, "alexnet-small"),
    ))
    return {a.name: a for a in archs}


ARCHITECTURES: dict[str, ArchInfo] = _registry()

ASSIGNMENT_MODES = ("round-robin", "blocks", "random")


def _unknown_arch(value: object) -> ModelConfigError:
    return ModelConfigError(
        f"unknown architecture {value!r}; valid names: {', '.join(ARCHITECTURES)}, or an "
        "import path 'package.module:Class' of your own model (see client_models.custom)"
    )


def _known(name: object) -> bool:
    return isinstance(name, str) and (name in ARCHITECTURES or is_import_path(name))


def build_model(
    arch: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    feature_dim: int | None = None,
    width: float = 1.0,
) -> HeteroModel:
    """Build architecture ``arch`` for inputs of ``input_shape`` (C, H, W) and ``num_classes``.

    ``feature_dim=None`` keeps the architecture's native representation size; otherwise the
    representation is made ``feature_dim``-dimensional (FedGH CNNs: fc2's size; other families:
    an appended Linear + ReLU projection).  ``width`` scales the layer widths (torchvision
    backbones accept only 1.0).  Weights use PyTorch's default init from the global RNG.
    """
    if not _known(arch):
        raise _unknown_arch(arch)
    shape = check_common_args(arch, input_shape, num_classes, feature_dim, width)
    if arch not in ARCHITECTURES:  # a user's model (client_models.custom)
        return build_custom(arch, shape, int(num_classes),
                            None if feature_dim is None else int(feature_dim), float(width))
    return ARCHITECTURES[arch].builder(
        input_shape=shape,
        num_classes=int(num_classes),
        feature_dim=None if feature_dim is None else int(feature_dim),
        width=float(width),
    )


def parse_arch_mix(text: str) -> list[str]:
    """Split a comma-separated architecture list, e.g. ``"cnn1,cnn2, cnn3"``, and check the names.

    Repeats are allowed (``"cnn1,cnn1,cnn5"`` gives cnn1 to two thirds of the clients).
    """
    if not isinstance(text, str) or not text.strip():
        raise ModelConfigError(
            f"architecture mix {text!r} is empty; give comma-separated names from: "
            f"{', '.join(ARCHITECTURES)}"
        )
    # Import paths keep their case (Python names are case-sensitive).
    names = [part.strip() if is_import_path(part.strip()) else part.strip().lower()
             for part in text.split(",")]
    for position, name in enumerate(names, start=1):
        if not name:
            raise ModelConfigError(
                f"architecture mix {text!r} has an empty entry at position {position}; "
                f"valid names: {', '.join(ARCHITECTURES)}"
            )
        if not _known(name):
            raise _unknown_arch(name)
    return names


def assign_architectures(
    mix: list[str], num_clients: int, mode: str = "round-robin", seed: int = 0
) -> list[str]:
    """Architecture of each client 0..num_clients-1, drawn from ``mix``.

    Modes:
      * ``"round-robin"``: client k gets ``mix[k % len(mix)]`` (FedGH, FedClassAvg, FedHe).
      * ``"blocks"``: contiguous groups in mix order, sizes differing by at most one
        (the first ``num_clients % len(mix)`` groups get the extra client).
      * ``"random"``: the round-robin multiset shuffled with ``numpy.random.default_rng(seed)``,
        so every architecture keeps the same client count, only positions change.
    """
    if not mix:
        raise ModelConfigError(
            f"architecture mix is empty; valid names: {', '.join(ARCHITECTURES)}"
        )
    for name in mix:
        if not _known(name):
            raise _unknown_arch(name)
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ModelConfigError(
            f"num_clients={num_clients!r} is not allowed: expected an integer >= 1"
        )
    return assign(mix, num_clients, mode, seed)


def assign(items: list, num_clients: int, mode: str = "round-robin", seed: int = 0) -> list:
    """What each client 0..num_clients-1 gets of ``items`` (architectures, DepthFL's depths),
    by ``mode`` as :func:`assign_architectures` describes."""
    if mode not in ASSIGNMENT_MODES:
        raise ModelConfigError(
            f"unknown assignment mode {mode!r}; valid modes: {', '.join(ASSIGNMENT_MODES)}"
        )
    round_robin = [items[k % len(items)] for k in range(num_clients)]
    if mode == "round-robin":
        return round_robin
    if mode == "blocks":
        base, extra = divmod(num_clients, len(items))
        assigned: list = []
        for i, name in enumerate(items):
            assigned += [name] * (base + (1 if i < extra else 0))
        return assigned
    order = np.random.default_rng(seed).permutation(num_clients)
    return [round_robin[i] for i in order]
