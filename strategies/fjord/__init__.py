"""FjORD's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``; the page: docs/fjord.md)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from fedapp.config import ConfigError, RunConfig, opt
from fedapp.runtime.submodel_settings import SubmodelSettings, width_rate
from strategies import Method


@dataclass(frozen=True)
class FjORDSettings(SubmodelSettings):
    """``fjord.*``: the kit's global model and tiers (each client's p_max), and FjORD's widths."""

    rates: str = opt(
        "0.2:1-0.4:1-0.6:1-0.8:1-1:1", "each client's tier p_max, in the kit's forms "
        "(docs/submodels.md); default: FjORD's five uniform tiers over consecutive partition "
        "ids (Flower's baseline: client c gets 0.2 * (c // 20 + 1) of 100)")
    widths: str = opt("0.2,0.4,0.6,0.8,1", "P, the widths a client samples from per batch "
                      "(those <= its p_max), comma-separated, each in (0, 1]")
    kd: bool = opt(
        False, "self-distillation (Flower's baseline's train_mode fjord_kd; its default "
        "fjord is off): each batch also trains the client's p_max output with CE, and the "
        "sampled width learns from that output's detached softmax instead of the labels")
    kd_alpha: float = opt(
        1.0, "with kd: the sampled width's loss is (1 - alpha) CE(labels) + alpha T^2 "
        "CE(softmax(p_max output / T)); 1 = the baseline's (soft targets alone)", low=0.0,
        high=1.0)
    kd_temperature: float = opt(
        1.0, "with kd: the distillation temperature T (the baseline's 1)", low=0.0,
        low_open=True)

    def width_set(self) -> tuple[Fraction, ...]:
        return tuple(sorted({width_rate(t.strip()) for t in self.widths.split(",")}))

    def model_options(self, rate: Fraction) -> dict:
        return {"norm": "per-width", "scaler": False, "od_widths": self.width_set()}

    def check(self, cfg: RunConfig) -> None:
        try:
            widths = self.width_set()
        except ValueError as exc:
            raise ConfigError(f"setting fjord.widths = {self.widths!r} is invalid: {exc}"
                              ) from None
        if widths[-1] != 1:
            raise ConfigError(f"setting fjord.widths = {self.widths!r} is invalid: it must "
                              "include 1, the global model's width")
        super().check(cfg)
        outside = sorted({float(r) for r in self.plan(cfg).values()} - set(map(float, widths)))
        if outside:
            raise ConfigError(f"setting fjord.rates = {self.rates!r} is invalid: tiers "
                              f"{outside} are not in fjord.widths = {self.widths!r}")


# Flower's baseline (conf/common.yaml, models.train): SGD lr 0.1, no momentum, weight decay
# 1e-4, batch 32, one local epoch, a constant ("static") learning rate, no clipping.
RECIPE = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "weight-decay": 1e-4,
          "grad-clip": 0.0, "optimizer-state": "fresh", "batch-size": 32, "local-epochs": 1,
          "local-steps": 0, "lr-decay-at": ""}

METHOD = Method("ordered dropout: a client of tier p_max trains, per batch, the leading-channel "
                "sub-model of a width drawn from those <= p_max; per-width BatchNorm; nested "
                "slices averaged by samples over the clients holding them",
                strategy_class="FjORD", client_class="FjORDClient", settings=FjORDSettings,
                recipe=RECIPE, payload_kinds=("sub-model",),
                secure_aggregation="fixed-layout")
