"""Width-sliceable models: one global network whose sub-models keep ⌈r·w⌉ channels of every
hidden layer (HeteroFL, FedRolex, FjORD; docs/submodels.md).

A model of rate r ∈ (0, 1] is built directly at its width, never as the global model with
channels masked out: a client of rate 1/16 holds 1/256 of the global convolutions' weights.
Which global channels a slice holds is the index maps' business
(:mod:`fedapp.runtime.submodels`); here only the shapes and the layers live.

- Widths are ⌈r·w⌉ computed on exact rationals, as HeteroFL's ``np.ceil(model_rate * x)``
  meant to and FjORD's ``ceil(p * w)`` should (FjORD's 0.6000000000000001 would give one
  channel too many wherever 0.6·w is an integer): ``scale_channels``'s ``round()`` of the zoo
  gives 38 for 0.6·64 where the papers need 39.
- Normalisation (``norm``): ``"static"`` is HeteroFL's static BatchNorm (batch statistics,
  nothing tracked, affine sliced with the channels); ``"none"`` leaves it out.
- The Scaler (HeteroFL): divides its input by r/r_global while training, identity in eval, so
  that a narrow sub-model's pre-activations have the global model's scale.

Families (``WIDTH_FAMILIES``; every model is a :class:`~client_models.base.HeteroModel`, the
extractor ending in average pooling so that the head's input is the last layer's channels):

- ``heterofl-conv``: HeteroFL's MNIST/FMNIST "conv" (``src/models/conv.py``): 3x3 convs
  64-128-256-512 each followed by Scaler, BN, ReLU, with 2x2 max-pooling between blocks; global
  average pooling and Linear(512, C). 1,556,874 parameters at r = 1 on 1x28x28, C = 10.
- ``heterofl-resnet{10,14,18,22,26}``: HeteroFL's pre-activation ResNet (``resnet.py``) with
  the zoo's stage depths (``resnets.RESNET_STAGE_BLOCKS``; HeteroFL's ResNet-18 is
  [2, 2, 2, 2], Felo's global model a ResNet-26): stem conv3x3 64, four stages 64-128-256-512
  with strides 1-2-2-2, each block BN-ReLU-conv-BN-ReLU-conv plus an identity or 1x1 shortcut
  taken after the first BN-ReLU, then BN-ReLU, average pooling and Linear(512, C).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import HeteroModel, ModelConfigError, check_common_args, too_small
from .resnets import RESNET_STAGE_BLOCKS

CONV_WIDTHS = (64, 128, 256, 512)  # HeteroFL's cfg['conv']['hidden_size']
RESNET_WIDTHS = (64, 128, 256, 512)  # cfg['resnet']['hidden_size']
NORMS = ("static", "none", "per-width")


def exact_rate(rate: float | Fraction | str) -> Fraction:
    """``rate`` as an exact fraction: 0.6 is 3/5, not 0.59999999999999997779."""
    return Fraction(str(rate)) if not isinstance(rate, Fraction) else rate


def width_channels(channels: int, rate: float | Fraction | str) -> int:
    """⌈r·w⌉ on exact rationals, never below 1 (HeteroFL's and FjORD's rounding)."""
    return max(1, math.ceil(exact_rate(rate) * channels))


class Scaler(nn.Module):
    """HeteroFL's Scaler: ``x / rate`` while training, ``x`` in evaluation."""

    def __init__(self, rate: float | Fraction) -> None:
        super().__init__()
        self.rate = float(rate)

    def forward(self, x: Tensor) -> Tensor:
        return x / self.rate if self.training else x

    def extra_repr(self) -> str:
        return f"rate={self.rate:g}"


def static_bn(channels: int) -> nn.BatchNorm2d:
    """HeteroFL's static BatchNorm: batch statistics in training and evaluation alike, nothing
    tracked (``momentum=None, track_running_stats=False``); the affine γ, β are sliced with the
    channels. :func:`fedapp.runtime.submodels.with_statistics` gives it statistics for
    evaluation (sBN)."""
    return nn.BatchNorm2d(channels, momentum=None, track_running_stats=False)


class ODConv2d(nn.Conv2d):
    """FjORD's ordered-dropout convolution: at the model's active width p it uses the leading
    ⌈p·G⌉ output channels (G: the layer's global width) of its weights and as many input
    channels as its input has; with no active width, the whole layer (a plain Conv2d)."""

    def __init__(self, *args, global_out: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.global_out = global_out
        self.active: Fraction | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.active is None:
            return super().forward(x)
        k = width_channels(self.global_out, self.active)
        bias = self.bias[:k] if self.bias is not None else None
        return F.conv2d(x, self.weight[:k, :x.shape[1]], bias, self.stride, self.padding)


class ODLinear(nn.Linear):
    """The head under ordered dropout: all C outputs, its inputs the active width's."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight[:, :x.shape[1]], self.bias)


class PerWidthBN(nn.Module):
    """FjORD's ``ODBatchNorm2d``: one affine-free BatchNorm with its own running statistics per
    width p of ``widths`` (buffers ``running_mean_<i>``, ``running_var_<i>``, i the width's
    index in the run's list P, so that a slice's buffers have the global model's names), and
    one shared affine γ, β sliced to the active width. Momentum 0.1, as BatchNorm2d's."""

    def __init__(self, channels: int, global_channels: int,
                 widths: dict[int, Fraction]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.widths = widths  # index in P -> p, the widths this model can run at
        self.active: Fraction | None = None
        for i, p in widths.items():  # width p's statistics: its ⌈p·G⌉ channels
            size = width_channels(global_channels, p)
            self.register_buffer(f"running_mean_{i}", torch.zeros(size))
            self.register_buffer(f"running_var_{i}", torch.ones(size))

    def forward(self, x: Tensor) -> Tensor:
        p = self.active if self.active is not None else max(self.widths.values())
        i = next(i for i, q in self.widths.items() if q == p)
        c = x.shape[1]
        return F.batch_norm(x, getattr(self, f"running_mean_{i}"),
                            getattr(self, f"running_var_{i}"), self.weight[:c],
                            self.bias[:c], self.training, 0.1, 1e-5)


def set_width(model: nn.Module, p: Fraction | None) -> None:
    """Run every ordered-dropout layer of ``model`` at width p (None: the model's own)."""
    for module in model.modules():
        if isinstance(module, (ODConv2d, PerWidthBN)):
            module.active = p


def _check_input(body: nn.Module, input_shape: tuple[int, int, int], arch: str) -> None:
    """Refuse an input the poolings shrink to nothing, naming the smallest that works. A batch
    of two zeros: static BNs use batch statistics even in evaluation, which a single 1x1 map
    does not have (the zoo's ``probe_output_shape`` sends one image)."""
    def error_of(shape: tuple[int, int, int]) -> str:
        try:
            with torch.no_grad():
                body(torch.zeros(2, *shape))
        except (RuntimeError, ValueError) as error:
            return str(error).strip().splitlines()[0]
        return ""

    torch_error = error_of(input_shape)
    if torch_error:
        raise too_small(input_shape, arch, torch_error, lambda shape: not error_of(shape))


def _norm(kind: str, channels: int) -> nn.Module:
    return static_bn(channels) if kind == "static" else nn.Identity()


def global_widths(widths: tuple[int, ...], width: float) -> list[int]:
    """The global model's layer widths under the run's ``model-width`` (⌈width·w⌉): a
    CPU-sized global model, which the rates then slice."""
    return [width_channels(w, width) for w in widths]


def build_heterofl_conv(input_shape: tuple[int, int, int], num_classes: int, rate: Fraction,
                        norm: str = "static", scaler: bool = True,
                        width: float = 1.0, od_widths: tuple[Fraction, ...] = ()
                        ) -> HeteroModel:
    full = global_widths(CONV_WIDTHS, width)
    widths = [width_channels(w, rate) for w in full]
    # FjORD (norm "per-width"): the widths of P this model can run at, by their index in P.
    allowed = {i: p for i, p in enumerate(od_widths) if p <= rate}
    layers: list[nn.Module] = []
    in_channels = input_shape[0]
    for i, out_channels in enumerate(widths):
        layers += [ODConv2d(in_channels, out_channels, 3, 1, 1, global_out=full[i]),
                   Scaler(rate) if scaler else nn.Identity(),
                   PerWidthBN(out_channels, full[i], allowed) if norm == "per-width"
                   else _norm(norm, out_channels),
                   nn.ReLU(inplace=True)]
        if i < len(widths) - 1:
            layers.append(nn.MaxPool2d(2))
        in_channels = out_channels
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    body = nn.Sequential(*layers)
    _check_input(body, input_shape, "heterofl-conv")
    model = HeteroModel("heterofl-conv", "heterofl-conv", input_shape, body, widths[-1],
                        num_classes)
    model.head = ODLinear(widths[-1], num_classes)
    return model


class PreActBlock(nn.Module):
    """HeteroFL's ``Block``: pre-activation BasicBlock; the shortcut (a 1x1 conv when the
    shape changes) reads the block's first BN-ReLU output, as the code's. Its convolutions
    are ordered-dropout ones (plain convolutions unless a width is set: FjORD's)."""

    def __init__(self, in_planes: int, planes: int, stride: int, rate: Fraction,
                 norm: Callable[[int, int], nn.Module], scaler: bool, global_in: int,
                 global_planes: int) -> None:
        super().__init__()
        self.n1 = norm(in_planes, global_in)
        self.conv1 = ODConv2d(in_planes, planes, 3, stride, 1, bias=False,
                              global_out=global_planes)
        self.n2 = norm(planes, global_planes)
        self.conv2 = ODConv2d(planes, planes, 3, 1, 1, bias=False, global_out=global_planes)
        self.scaler = Scaler(rate) if scaler else nn.Identity()
        self.shortcut = (ODConv2d(in_planes, planes, 1, stride, bias=False,
                                  global_out=global_planes)
                         if stride != 1 or in_planes != planes else None)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.n1(self.scaler(x)))
        shortcut = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.n2(self.scaler(out))))
        return out + shortcut


class PreActTail(nn.Module):
    """The last BN-ReLU before pooling (HeteroFL's ``n4`` with its Scaler)."""

    def __init__(self, n4: nn.Module, rate: Fraction, scaler: bool) -> None:
        super().__init__()
        self.scaler = Scaler(rate) if scaler else nn.Identity()
        self.n4 = n4

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.n4(self.scaler(x)))


def build_heterofl_resnet(arch: str, input_shape: tuple[int, int, int], num_classes: int,
                          rate: Fraction, norm: str = "static", scaler: bool = True,
                          width: float = 1.0, od_widths: tuple[Fraction, ...] = ()
                          ) -> HeteroModel:
    blocks = RESNET_STAGE_BLOCKS[arch.removeprefix("heterofl-")]
    full = global_widths(RESNET_WIDTHS, width)
    widths = [width_channels(w, rate) for w in full]
    # FjORD (norm "per-width"): the widths of P this model can run at, by their index in P.
    allowed = {i: p for i, p in enumerate(od_widths) if p <= rate}

    def norm_of(channels: int, global_channels: int) -> nn.Module:
        return (PerWidthBN(channels, global_channels, allowed) if norm == "per-width"
                else _norm(norm, channels))

    layers: list[nn.Module] = [ODConv2d(input_shape[0], widths[0], 3, 1, 1, bias=False,
                                        global_out=full[0])]
    in_planes, global_in = widths[0], full[0]
    for planes, global_planes, count, stride in zip(widths, full, blocks, (1, 2, 2, 2)):
        stage = []
        for i in range(count):
            stage.append(PreActBlock(in_planes, planes, stride if i == 0 else 1, rate,
                                     norm_of, scaler, global_in, global_planes))
            in_planes, global_in = planes, global_planes
        layers.append(nn.Sequential(*stage))
    layers += [PreActTail(norm_of(widths[-1], full[-1]), rate, scaler),
               nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    body = nn.Sequential(*layers)
    _check_input(body, input_shape, arch)
    model = HeteroModel(arch, "heterofl-resnet", input_shape, body, widths[-1], num_classes)
    if norm == "per-width":  # FjORD's head reads the active width's features; same weights
        head = ODLinear(widths[-1], num_classes)
        head.load_state_dict(model.head.state_dict())
        model.head = head
    return model


WIDTH_FAMILIES: dict[str, str] = {
    "heterofl-conv": "HeteroFL's conv: 3x3 convs 64-128-256-512 (Scaler, BN, ReLU, max-pool), "
                     "average pooling, Linear(512, C)",
    **{f"heterofl-{name}": f"HeteroFL's pre-activation ResNet, blocks per stage "
                           f"{list(blocks)}, widths 64-128-256-512"
       for name, blocks in RESNET_STAGE_BLOCKS.items()},
}


def check_rate(rate: object, what: str = "rate") -> Fraction:
    """``rate`` as an exact fraction in (0, 1]; ModelConfigError otherwise."""
    try:
        exact = exact_rate(rate) if not isinstance(rate, bool) else None
    except (ValueError, ZeroDivisionError, TypeError):
        exact = None
    if exact is None or not 0 < exact <= 1:
        raise ModelConfigError(f"{what} {rate!r} is not allowed: a sub-model's width rate must "
                               "be a number in (0, 1] (1 = the global model)")
    return exact


def build_width_model(arch: str, input_shape: tuple[int, int, int], num_classes: int,
                      rate: float | Fraction | str = 1, norm: str = "static",
                      scaler: bool = True, width: float = 1.0,
                      od_widths: tuple[Fraction, ...] = ()) -> HeteroModel:
    """The sub-model of rate ``rate`` of the width-sliceable ``arch`` (``WIDTH_FAMILIES``):
    every hidden layer ⌈rate·W⌉ channels wide, W = ⌈width·w⌉ the global model's (``width``:
    the run's ``model-width``, 1 in the papers); the input channels and the C outputs stay."""
    if arch not in WIDTH_FAMILIES:
        raise ModelConfigError(
            f"architecture {arch!r} cannot be sliced by width: the sub-model methods need one "
            f"of {', '.join(WIDTH_FAMILIES)} (docs/submodels.md)")
    exact = check_rate(rate)
    if norm not in NORMS:
        raise ModelConfigError(f"norm {norm!r} is not allowed: expected one of {NORMS}")
    shape = check_common_args(arch, input_shape, num_classes, None, width)
    if arch == "heterofl-conv":
        return build_heterofl_conv(shape, int(num_classes), exact, norm, scaler, width,
                                   od_widths)
    return build_heterofl_resnet(arch, shape, int(num_classes), exact, norm, scaler, width,
                                 od_widths)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def static_norms(model: nn.Module) -> list[nn.BatchNorm2d]:
    """The model's BatchNorm layers (static ones track nothing until given statistics)."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

