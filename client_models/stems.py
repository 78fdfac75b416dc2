"""Where a client model is cut for FedGKT: its *stem*, whose feature map the client uploads.

FedGKT's server trains one model on every client's maps, so the stems of a federation must all
emit the same ``(channels, height, width)``; :func:`common_stem_shape` checks that before a run.
The stem is a prefix of the model's body (``extractor[0]``, the layers before any flattening),
so cutting there needs no change to a family's models: :func:`stem` returns those modules
(shared with the model), and the model's own forward pass is unchanged.
"""

from __future__ import annotations

from torch import nn

from .base import HeteroModel, ModelConfigError, probe_output_shape
from .gkt import CLIENT_FAMILY
from .registry import build_model

# Where each family's stem ends: the stem is the first ``n`` modules of the model's body
# (``extractor[0]``, the convolutions before any flattening). A family not listed has no
# stem FedGKT can cut at.
STEM_MODULES: dict[str, int] = {
    "fedgh-cnn": 3,   # conv1 5x5 (16 x width) -> ReLU -> max-pool 2: 16x12x12 on 28x28
    "resnet": 3,      # conv 3x3 (64 x width) -> BN -> ReLU, full resolution
    CLIENT_FAMILY: 3,  # conv 3x3 (16 x width) -> BN -> ReLU, full resolution
}


def stem(model: HeteroModel) -> nn.Sequential:
    """The stem of ``model`` (sharing its modules): ``stem(model)(x)`` is the feature map that
    FedGKT uploads. Raises ModelConfigError for a family without one."""
    n = STEM_MODULES.get(model.family)
    if n is None:
        raise ModelConfigError(
            f"architecture {model.arch!r} (family {model.family!r}) has no stem to cut at; "
            f"families with one: {', '.join(STEM_MODULES)}")
    return model.extractor[0][:n]


def stem_shapes(archs: list[str], input_shape: tuple[int, int, int], num_classes: int,
                feature_dim: int | None = None, width: float = 1.0) -> dict[str, tuple[int, ...]]:
    """The feature-map shape ``(channels, height, width)`` each architecture's stem emits on
    inputs of ``input_shape`` (raises ModelConfigError for one without a stem)."""
    shapes = {}
    for arch in dict.fromkeys(archs):
        model = build_model(arch, input_shape, num_classes, feature_dim=feature_dim, width=width)
        shapes[arch] = tuple(probe_output_shape(stem(model), input_shape, arch))
    return shapes


def common_stem_shape(archs: list[str], input_shape: tuple[int, int, int], num_classes: int,
                      feature_dim: int | None = None, width: float = 1.0) -> tuple[int, ...]:
    """The one feature-map shape every architecture's stem emits; ModelConfigError naming
    each architecture's shape when they differ (one server model cannot take them all)."""
    shapes = stem_shapes(archs, input_shape, num_classes, feature_dim, width)
    if len(set(shapes.values())) > 1:
        raise ModelConfigError(
            "the architectures' stems emit feature maps of different shapes ("
            + ", ".join(f"{a}: {'x'.join(map(str, s))}" for a, s in shapes.items())
            + "), and one server model must take them all; use architectures whose stems "
            "agree, e.g. cnn1..cnn5 (16x12x12 on 28x28) or gkt-resnet5/8/11 (16x28x28)")
    return next(iter(shapes.values()))
