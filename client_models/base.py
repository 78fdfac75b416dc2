"""The common model shape of every client: a feature extractor g plus a linear head h.

All five methods split a client model the same way:
``z = g(x)`` is a representation in R^d and ``logits = h(z)`` with ``h = Linear(d, C)``.
FedGH and FedClassAvg share ``h``, CompFL shares ``g``, FedHe shares nothing, so the split
(and the state-dict key prefixes ``extractor.`` / ``head.``) must be the same for every family.

This module also holds the small helpers every family uses, so the family modules only
describe their layers: input/width validation, output-size probing, and the optional
projection to a common feature dimension.
"""

from __future__ import annotations

import itertools
import math
import numbers
from typing import Callable

import torch
from torch import Tensor, nn


class ModelConfigError(ValueError):
    """A model setting (architecture name, input shape, width, ...) is not allowed.

    The message always names the bad value and says what is allowed, so a run can be
    rejected before any training starts.
    """


class HeteroModel(nn.Module):
    """Every client model: an extractor g (x -> z in R^d) plus a linear head h (z -> logits).

    Attributes:
        arch: registry name the model was built from (e.g. ``"cnn1"``).
        family: architecture family (e.g. ``"fedgh-cnn"``), handy for per-group averaging.
        input_shape: ``(channels, height, width)`` the model was built for.
        feature_dim: d, the size of the representation ``z``.
        num_classes: C.
        extractor: maps ``x [B, *input_shape]`` to ``z [B, d]``.
        head: ``nn.Linear(d, C)``; its state-dict keys are ``head.weight`` and ``head.bias``.
    """

    def __init__(
        self,
        arch: str,
        family: str,
        input_shape: tuple[int, int, int],
        extractor: nn.Module,
        feature_dim: int,
        num_classes: int,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.family = family
        self.input_shape = tuple(input_shape)
        self.feature_dim = feature_dim
        self.num_classes = num_classes
        self.extractor = extractor
        self.head = nn.Linear(feature_dim, num_classes)

    def features(self, x: Tensor) -> Tensor:
        """Representation z = g(x), shape [B, feature_dim]."""
        return self.extractor(x)

    def forward(self, x: Tensor) -> Tensor:
        """Logits h(g(x)), shape [B, num_classes]."""
        return self.head(self.features(x))

    def head_state(self) -> dict[str, Tensor]:
        """Detached copies of the head's state-dict entries (``head.weight``, ``head.bias``)."""
        return {k: v.detach().clone() for k, v in self.state_dict().items() if _is_head_key(k)}

    def extractor_state(self) -> dict[str, Tensor]:
        """Detached copies of every other state-dict entry, BatchNorm buffers included."""
        return {k: v.detach().clone() for k, v in self.state_dict().items() if not _is_head_key(k)}


def _is_head_key(key: str) -> bool:
    return key.startswith("head.")


# ----------------------------------------------------------------------------------------
# Helpers shared by the family modules
# ----------------------------------------------------------------------------------------


def scale_channels(channels: int, width: float) -> int:
    """``channels * width`` rounded to the nearest integer, never below 1."""
    return max(1, int(round(channels * width)))


def check_common_args(
    arch: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    feature_dim: int | None,
    width: float,
) -> tuple[int, int, int]:
    """Validate the arguments every builder takes; return ``input_shape`` as a tuple of ints."""
    shape = tuple(input_shape) if isinstance(input_shape, (tuple, list)) else None
    if shape is None or len(shape) != 3 or not all(_is_positive_int(s) for s in shape):
        raise ModelConfigError(
            f"input_shape={input_shape!r} for {arch!r} is not allowed: "
            "expected (channels, height, width) with three positive integers, e.g. (1, 28, 28)"
        )
    if not _is_positive_int(num_classes):
        raise ModelConfigError(
            f"num_classes={num_classes!r} for {arch!r} is not allowed: expected a positive integer"
        )
    if feature_dim is not None and not _is_positive_int(feature_dim):
        raise ModelConfigError(
            f"feature_dim={feature_dim!r} for {arch!r} is not allowed: "
            "expected None (the architecture's native size) or a positive integer"
        )
    if isinstance(width, bool) or not isinstance(width, (int, float)) or not (
        math.isfinite(width) and width > 0
    ):
        raise ModelConfigError(
            f"width={width!r} for {arch!r} is not allowed: expected a finite number > 0"
        )
    return tuple(int(s) for s in shape)  # type: ignore[return-value]


def _is_positive_int(value: object) -> bool:
    # numbers.Integral also admits numpy integers (e.g. shapes read from arrays).
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


def probe_output_shape(body: nn.Module, input_shape: tuple[int, int, int], arch: str) -> torch.Size:
    """Shape of ``body``'s output for one input of ``input_shape`` (batch dimension dropped).

    Used to size the first Linear layer after the convolutions instead of hard-coding
    flatten sizes (e.g. FedGH's conv2_ch*5*5 holds for 32x32 only, 28x28 gives *4*4).
    Raises ModelConfigError if the input is too small for the layers' down-sampling.
    """
    shape, torch_error = _try_output_shape(body, input_shape)
    if shape is None:
        raise too_small(input_shape, arch, torch_error,
                        lambda size: _try_output_shape(body, size)[0] is not None)
    return shape


_MAX_PROBED_SIZE = 64


def too_small(input_shape: tuple[int, int, int], arch: str, torch_error: str,
              works: Callable[[tuple[int, int, int]], bool]) -> ModelConfigError:
    """The error for an input that a model's down-sampling shrinks to nothing, naming the
    smallest square input that ``works`` accepts (searched above the given one: inputs of real
    datasets are far above it, so a small search range is enough)."""
    channels, height, width = input_shape
    smallest = next((s for s in range(min(height, width) + 1, _MAX_PROBED_SIZE + 1)
                     if works((channels, s, s))), None)
    hint = (f"the smallest square input that works is {smallest}x{smallest}" if smallest
            else f"no square input up to {_MAX_PROBED_SIZE}x{_MAX_PROBED_SIZE} works "
            f"({torch_error})")
    return ModelConfigError(f"input_shape={tuple(input_shape)} is too small for {arch!r}: its "
                            f"convolutions and poolings shrink the image to nothing; {hint}")


def _try_output_shape(
    body: nn.Module, input_shape: tuple[int, int, int]
) -> tuple[torch.Size | None, str]:
    """(output shape without batch dim, "") or (None, why torch refused) for one zero input."""
    # The probe goes where the body's weights are: a model already moved to a GPU (FedGKT's
    # client measuring its stem's maps) would refuse a CPU input as "too small".
    device = next(itertools.chain(body.parameters(), body.buffers()),
                  torch.zeros(())).device
    # Eval mode so BatchNorm neither fails on a 1x1 map nor updates its running statistics
    # with the probe's zeros; the previous mode is restored afterwards.
    was_training = body.training
    body.eval()
    try:
        with torch.no_grad():
            out = body(torch.zeros(1, *input_shape, device=device))
    except (RuntimeError, ValueError) as error:
        return None, str(error).strip().splitlines()[0]
    finally:
        body.train(was_training)
    if out.numel() == 0:
        return None, f"empty output of shape {tuple(out.shape)}"
    return out.shape[1:], ""


def flatten_dim(body: nn.Module, input_shape: tuple[int, int, int], arch: str) -> int:
    """Number of features after flattening ``body``'s output (see probe_output_shape)."""
    return math.prod(probe_output_shape(body, input_shape, arch))


def finish_model(
    arch: str,
    family: str,
    input_shape: tuple[int, int, int],
    body: nn.Module,
    native_dim: int,
    num_classes: int,
    feature_dim: int | None,
) -> HeteroModel:
    """Wrap ``body`` (x -> [B, native_dim] after flattening) into a HeteroModel.

    ``feature_dim=None`` keeps the native representation.  Otherwise a projection
    ``Linear(native_dim, feature_dim)`` followed by ReLU is appended inside the extractor,
    so that heterogeneous extractors meet one common d (FedGH 500, FedClassAvg 512).
    The ReLU keeps representations post-activation in every family, as FedGH's post-ReLU
    fc2 (official ``Models/CNNs.py``).  FedClassAvg's code puts that ReLU in front of its
    classifier instead: same logits, but its contrastive loss sees the pre-ReLU features.
    """
    layers: list[nn.Module] = [body, nn.Flatten()]
    d = native_dim
    if feature_dim is not None:
        layers += [nn.Linear(native_dim, feature_dim), nn.ReLU(inplace=True)]
        d = feature_dim
    return HeteroModel(arch, family, input_shape, nn.Sequential(*layers), d, num_classes)
