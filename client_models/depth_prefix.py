"""Depth-prefix models: one global network cut into stages, with an exit classifier after every
stage, such that the depth-d model is exactly the first d stages of the global model and their
d exits (DepthFL, Kim et al., ICLR 2023).

The zoo's ResNets (``client_models.resnets``) differ in blocks *per stage*, so none is a prefix
of another. Here a family is one global network; a client of depth d holds

    stem, stages.0 .. stages.{d-1}, exits.0 .. exits.{d-1}

whose state-dict entries carry the global model's names and shapes
(:func:`prefix_names`), so a prefix travels and is averaged by name, with no index map.

Families (``DEPTH_FAMILIES``):

* ``resnet10`` .. ``resnet26``: the zoo's CIFAR-style ResNets (3x3 stem without max-pooling,
  BasicBlock stages 64-128-256-512 x width, strides 1-2-2-2), cut after each stage, with
  DepthFL's exits (Flower's ``baselines/depthfl/resnet.py``, by the paper's first author):
  exit i < D is an attention gate (SepConv, BN, ReLU, upsampling to the stage's map, sigmoid)
  multiplied with the stage's output, then a stack of stride-2 depthwise-separable convs up to
  the last stage's width, average pooling and a Linear; the last exit is average pooling and a
  Linear. ``resnet18`` ([2, 2, 2, 2]) is DepthFL's model.
* ``cnn4``: HeteroFL's MNIST conv layout (3x3 convs 64-128-256-512 x width, each followed by BN
  and ReLU, 2x2 max-pooling before blocks 2-4) with an exit after each block: average pooling
  and a Linear, the "4-block CNN with a linear exit per block".

The reference upsamples the attention map by a factor 2; on 28x28 inputs the third stage's map
is 7x7 and a stride-2 conv gives 4x4, which x2 does not bring back to 7x7. The gate is
upsampled to the stage map's own size instead: the same operation wherever the size is even
(CIFAR's 32x32), and defined where it is odd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import ModelConfigError, check_common_args, probe_output_shape, scale_channels
from .resnets import RESNET_STAGE_BLOCKS, STAGE_STRIDES, STAGE_WIDTHS, residual_stage

CNN4_WIDTHS = (64, 128, 256, 512)

# Family name -> what it is (``fedapp methods``/errors list them).
DEPTH_FAMILIES: dict[str, str] = {
    **{name: f"the zoo's {name} ({list(blocks)} BasicBlocks per stage) cut after each of its "
             "4 stages, DepthFL's exits" for name, blocks in RESNET_STAGE_BLOCKS.items()},
    "cnn4": "HeteroFL's MNIST conv (3x3 convs 64-128-256-512 x width, BN, ReLU, 2x2 max-pool "
            "between blocks) with an exit (average pooling + Linear) after each block",
}


def max_depth(family: str) -> int:
    """D, the number of stages of ``family``'s global model (raises ModelConfigError for a
    model that has no depth-prefix form)."""
    check_family(family)
    return len(CNN4_WIDTHS) if family == "cnn4" else len(STAGE_WIDTHS)


def check_family(family: object) -> None:
    if family not in DEPTH_FAMILIES:
        raise ModelConfigError(
            f"model {family!r} has no depth-prefix form (stages whose first d make the depth-d "
            f"model, an exit after each); models that do: {', '.join(DEPTH_FAMILIES)}")


def check_depth(family: str, depth: object) -> int:
    """``depth`` as an int in 1..D of ``family``; raises ModelConfigError naming what is
    allowed."""
    top = max_depth(family)
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= top:
        raise ModelConfigError(f"depth {depth!r} is not allowed for {family!r}: expected an "
                               f"integer from 1 to {top}, its number of stages")
    return depth


def prefix_names(names, depth: int) -> list[str]:
    """The entries of the depth-``depth`` prefix among a global model's state-dict ``names``:
    the stem's and those of stages and exits 0..depth-1, in the given order."""
    def index(name: str) -> int:
        parts = name.split(".")
        return int(parts[1]) if parts[0] in ("stages", "exits") else -1
    return [n for n in names if index(n) < depth]


class SepConv(nn.Sequential):
    """DepthFL's depthwise-separable conv, applied twice: depthwise 3x3 (stride ``stride``),
    1x1, BN, ReLU, depthwise 3x3, 1x1 to ``out_channels``, BN, ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 2) -> None:
        c = in_channels
        super().__init__(
            nn.Conv2d(c, c, 3, stride=stride, padding=1, groups=c, bias=False),
            nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, c, 3, stride=1, padding=1, groups=c, bias=False),
            nn.Conv2d(c, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels), nn.ReLU())


class AttentionExit(nn.Module):
    """DepthFL's exit after a middle stage: an attention gate on the stage's map, then stride-2
    SepConvs through the widths of the later stages, average pooling and ``fc``."""

    def __init__(self, channels: int, later_widths: list[int], num_classes: int) -> None:
        super().__init__()
        self.attention = nn.Sequential(SepConv(channels, channels), nn.BatchNorm2d(channels),
                                       nn.ReLU())
        convs, c = [], channels
        for width in later_widths:
            convs.append(SepConv(c, width))
            c = width
        self.scala = nn.Sequential(*convs, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        # Upsampled to the map's own size (x2 in the reference: see the module's docstring).
        gate = torch.sigmoid(F.interpolate(self.attention(x), size=x.shape[-2:],
                                           mode="bilinear", align_corners=False))
        return self.fc(self.scala(gate * x))


class PoolExit(nn.Sequential):
    """An exit of average pooling and a Linear (DepthFL's last exit; every exit of ``cnn4``)."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))


class DepthPrefixModel(nn.Module):
    """The first ``depth`` stages of ``family``'s global model, with an exit after each.

    ``exit_logits(x)`` gives every exit's logits (shallowest first); ``forward(x)`` is their
    mean, the ensemble DepthFL predicts with."""

    def __init__(self, family: str, depth: int, input_shape: tuple[int, int, int],
                 num_classes: int, stem: nn.Module, stages: list[nn.Module],
                 exits: list[nn.Module]) -> None:
        super().__init__()
        self.family, self.depth, self.max_depth = family, depth, max_depth(family)
        self.input_shape, self.num_classes = tuple(input_shape), num_classes
        self.stem = stem
        self.stages = nn.ModuleList(stages[:depth])
        self.exits = nn.ModuleList(exits[:depth])

    def exit_logits(self, x: Tensor) -> list[Tensor]:
        x = self.stem(x)
        out = []
        for stage, head in zip(self.stages, self.exits):
            x = stage(x)
            out.append(head(x))
        return out

    def forward(self, x: Tensor) -> Tensor:
        return torch.stack(self.exit_logits(x)).mean(0)


def build_depth_model(family: str, depth: int, input_shape: tuple[int, int, int],
                      num_classes: int, width: float = 1.0) -> DepthPrefixModel:
    """The depth-``depth`` prefix of ``family``'s global model (widths x ``width``), with the
    reference's initialisation (Kaiming-normal fan-out convs, BN at 1 and 0; Linear layers as
    PyTorch's default) from torch's global generator (callers isolate it)."""
    check_family(family)
    depth = check_depth(family, depth)
    shape = check_common_args(family, input_shape, num_classes, None, width)
    stem, stages, exits = _layers(family, shape[0], num_classes, width)
    # The whole global model is initialised, layer after layer in its own order, before it is
    # cut: the depth-d model's initial weights are then the global model's first d stages'.
    for layer in (stem, *(m for pair in zip(stages, exits) for m in pair)):
        for m in layer.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
    model = DepthPrefixModel(family, depth, shape, num_classes, stem, stages, exits)
    probe_output_shape(_Deepest(model), shape, f"{family} at depth {depth}")
    return model


class _Deepest(nn.Module):
    """The deepest exit's logits (to probe that an input is large enough)."""

    def __init__(self, model: DepthPrefixModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model.exit_logits(x)[-1]


def _layers(family: str, in_channels: int, num_classes: int, width: float
            ) -> tuple[nn.Module, list[nn.Module], list[nn.Module]]:
    """(stem, every stage, every exit) of ``family``'s global model, created stage by stage."""
    if family == "cnn4":
        widths = [scale_channels(w, width) for w in CNN4_WIDTHS]
        stages, exits, c = [], [], in_channels
        for i, w in enumerate(widths):
            pool = [nn.MaxPool2d(2)] if i else []
            stages.append(nn.Sequential(*pool, nn.Conv2d(c, w, 3, padding=1, bias=False),
                                        nn.BatchNorm2d(w), nn.ReLU(inplace=True)))
            exits.append(PoolExit(w, num_classes))
            c = w
        return nn.Identity(), stages, exits
    widths = [scale_channels(w, width) for w in STAGE_WIDTHS]
    stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, stride=1, padding=1, bias=False),
                         nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True))
    stages, exits, c = [], [], widths[0]
    for i, (w, blocks, stride) in enumerate(zip(widths, RESNET_STAGE_BLOCKS[family],
                                                STAGE_STRIDES)):
        stages.append(residual_stage("BasicBlock", c, w, blocks, stride))
        last = i == len(widths) - 1
        exits.append(PoolExit(w, num_classes) if last
                     else AttentionExit(w, widths[i + 1:], num_classes))
        c = w
    return stem, stages, exits
