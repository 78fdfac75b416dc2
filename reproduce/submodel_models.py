"""The model a sub-model method's client trains, as a whole model of its own: what Standalone
trains beside HeteroFL, FedRolex, FjORD and DepthFL in docs/scoreboard.md and docs/defaults.md,
given to it by import path (``arch-mix = "reproduce.submodel_models:<name>"``,
client_models.custom; common.submodel_standalone writes the names).

- ``width__<arch>__<norm>__<scaler>__<p>_<q>``: ``<arch>`` at width rate p/q with the
  normalisation ``<norm>`` and the Scaler on (1) or off (0), as the method's ``model_options``
  build its clients' models (``-`` written ``_``): HeteroFL's and FedRolex's static BatchNorm
  and Scaler; FjORD's per-width BatchNorm, built with the client's own width p_max only (the
  statistics it runs at without ordered dropout; the narrower widths' statistics are buffers
  that only FjORD's sampled widths use). The client's slice, parameter for parameter
  (client_models.width.build_width_model).
- ``depth__<family>__<d>[__<p>_<q>]``: the first d stages of DepthFL's ``<family>`` (its
  channels x p/q where the name says, DepthFL's ``model-width``) and the exit after the d-th,
  the path from the input to the deepest exit of a depth-d client's model; its shallower
  exits, which only DepthFL's self-distillation trains, are left out
  (client_models.depth_prefix.build_depth_model).

Standalone then trains each with cross-entropy, as every zoo model, at ``model-width`` 1, the
only width a model given by import path takes: a width is part of the name.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Callable

from torch import nn


class Whole(nn.Module):
    """A model of the zoo's contract: ``extractor`` (x -> z) and a linear ``head``."""

    def __init__(self, extractor: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.extractor, self.head = extractor, head

    def forward(self, x):
        return self.head(self.extractor(x))


def width_name(arch: str, rate: Fraction, norm: str, scaler: bool) -> str:
    return (f"width__{arch}__{norm}__{int(scaler)}__{rate.numerator}_{rate.denominator}"
            .replace("-", "_"))


def depth_name(family: str, depth: int, width: Fraction = Fraction(1)) -> str:
    return f"depth__{family}__{depth}" + (
        "" if width == 1 else f"__{width.numerator}_{width.denominator}")


def width_model(arch: str, rate: Fraction, norm: str, scaler: bool) -> Callable[..., nn.Module]:
    from client_models.width import build_width_model
    od_widths = (rate,) if norm == "per-width" else ()

    def build(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
        model = build_width_model(arch, input_shape, num_classes, rate, norm, scaler,
                                  od_widths=od_widths)
        return Whole(model.extractor, model.head)
    return build


def depth_model(family: str, depth: int, width: Fraction = Fraction(1)
                ) -> Callable[..., nn.Module]:
    from client_models.depth_prefix import build_depth_model

    def build(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
        model = build_depth_model(family, depth, input_shape, num_classes, float(width))
        deepest = model.exits[-1]
        # Its last Linear is the head; the rest of the exit (pooling, or the attention gate
        # and its convolutions) ends the extractor.
        where, head = [(n, m) for n, m in deepest.named_modules()
                       if isinstance(m, nn.Linear)][-1]
        parent, _, attr = where.rpartition(".")
        setattr(deepest.get_submodule(parent) if parent else deepest, attr, nn.Identity())
        return Whole(nn.Sequential(model.stem, *model.stages, deepest), head)
    return build


def __getattr__(name: str) -> Any:
    """The builder ``name`` stands for (module attribute access: the import path's name)."""
    kind, *parts = name.split("__")
    try:
        if kind == "width" and len(parts) == 4 and parts[2] in ("0", "1"):
            arch, norm, scaler, rate = parts
            p, q = rate.split("_")
            return width_model(arch.replace("_", "-"), Fraction(int(p), int(q)),
                               norm.replace("_", "-"), scaler == "1")
        if kind == "depth" and len(parts) in (2, 3):
            p, q = parts[2].split("_") if len(parts) == 3 else (1, 1)
            return depth_model(parts[0], int(parts[1]), Fraction(int(p), int(q)))
    except ValueError:
        pass
    raise AttributeError(f"module {__name__!r} has no {name!r}: expected "
                         "width__<arch>__<norm>__<scaler>__<p>_<q> or "
                         "depth__<family>__<d>[__<p>_<q>]")
