"""Architectures given by import path: ``arch-mix = "mypackage.models:MyNet,cnn2"``.

A user's own network joins a run without editing the package if it follows the contract every
client model here follows (an extractor g and a linear head h, ``logits = h(g(x))``):

- ``package.module:Name`` names a class (or a function) importable by the server and the
  client processes (installed, or on ``PYTHONPATH``);
- ``Name(input_shape=(C, H, W), num_classes=K)`` returns a ``torch.nn.Module`` with
  ``extractor``: a module mapping ``x [B, C, H, W]`` to ``z [B, d]``, and
  ``head``: ``torch.nn.Linear(d, K)``;
- when the run sets a common ``feature-dim`` (FedGH's shared header, FedClassAvg's shared
  classifier) and d differs from it, ``Linear(d, feature-dim) + ReLU`` is appended to the
  extractor and the head becomes ``Linear(feature-dim, K)``, as for the built-in families.

The contract is checked when the run is configured (one forward pass of a zero batch), so a
model that breaks it is refused with a message before any training.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from .base import HeteroModel, ModelConfigError

FAMILY = "custom"


def is_import_path(name: str) -> bool:
    """``package.module:Name``: a user's architecture rather than a registered name."""
    module, _, attr = name.partition(":")
    return bool(module) and attr.isidentifier() and all(
        part.isidentifier() for part in module.split("."))


def build_custom(path: str, input_shape: tuple[int, int, int], num_classes: int,
                 feature_dim: int | None, width: float) -> HeteroModel:
    """The model ``path`` names, checked against the contract and wrapped as a HeteroModel."""
    if width != 1.0:
        raise ModelConfigError(f"{path}: model-width = {width} scales the registered "
                               "architectures only; a model given by import path is built as "
                               "it is (model-width = 1.0)")
    module_name, _, attr = path.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise ModelConfigError(f"{path}: cannot import {module_name!r} ({exc}); install it or "
                               "put its folder on PYTHONPATH") from None
    except AttributeError:
        raise ModelConfigError(f"{path}: module {module_name!r} has no {attr!r}") from None
    try:
        net = factory(input_shape=tuple(input_shape), num_classes=int(num_classes))
    except Exception as exc:  # the user's constructor: any failure is a configuration error
        raise ModelConfigError(f"{path}(input_shape={tuple(input_shape)}, num_classes="
                               f"{num_classes}) failed: {exc!r}") from None
    extractor, head = getattr(net, "extractor", None), getattr(net, "head", None)
    if not isinstance(extractor, nn.Module) or not isinstance(head, nn.Linear):
        raise ModelConfigError(f"{path}: the model must have an 'extractor' (a torch module, "
                               "x -> z [B, d]) and a 'head' (torch.nn.Linear(d, num_classes)); "
                               f"it has extractor={type(extractor).__name__}, "
                               f"head={type(head).__name__}")
    if head.out_features != num_classes:
        raise ModelConfigError(f"{path}: head has {head.out_features} outputs, the data set "
                               f"{num_classes} classes")
    was_training = extractor.training
    extractor.eval()
    try:
        with torch.no_grad():
            z = extractor(torch.zeros(2, *input_shape))
    except Exception as exc:
        raise ModelConfigError(f"{path}: the extractor fails on a batch of shape "
                               f"{(2, *input_shape)}: {exc!r}") from None
    finally:
        extractor.train(was_training)
    if not isinstance(z, torch.Tensor) or z.dim() != 2 or z.shape[1] != head.in_features:
        shape = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        raise ModelConfigError(f"{path}: the extractor must return z of shape [B, d] with d = "
                               f"head.in_features = {head.in_features}; it returned {shape}")
    d = head.in_features
    if feature_dim is not None and feature_dim != d:
        extractor = nn.Sequential(extractor, nn.Linear(d, feature_dim), nn.ReLU(inplace=True))
        d = feature_dim
    model = HeteroModel(path, FAMILY, input_shape, extractor, d, num_classes)
    if d == head.in_features and model.head.out_features == head.out_features:
        model.head = head  # the user's own head (and its initialisation)
    return model
