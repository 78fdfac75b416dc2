"""Heterogeneous client model zoo: every model is an extractor g plus a linear head h.

Usage::

    from client_models import build_model, parse_arch_mix, assign_architectures

    archs = assign_architectures(parse_arch_mix("cnn1,cnn2,cnn3,cnn4,cnn5"), num_clients=10)
    model = build_model(archs[k], input_shape=(1, 28, 28), num_classes=10, feature_dim=500)
    z = model.features(x)      # [B, 500]
    logits = model(x)          # [B, 10] = model.head(z)
"""

from .base import HeteroModel, ModelConfigError
from .registry import (
    ARCHITECTURES,
    ASSIGNMENT_MODES,
    ArchInfo,
    assign_architectures,
    build_model,
    parse_arch_mix,
)

__all__ = [
    "ARCHITECTURES",
    "ASSIGNMENT_MODES",
    "ArchInfo",
    "HeteroModel",
    "ModelConfigError",
    "assign_architectures",
    "build_model",
    "parse_arch_mix",
]
