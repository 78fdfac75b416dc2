"""FML's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import opt
from fedapp.runtime.recipes import HTFLLIB
from fedapp.runtime.two_model_settings import SharedModelSettings
from strategies import Method


@dataclass(frozen=True)
class FMLSettings(SharedModelSettings):
    """``fml.*``: the two models' loss weights and the KL's form."""

    # 0.9, chosen by measurement (docs/defaults.md): the paper's 0.5 (conf/fml-paper.toml) loses
    # 0.04 to local training at FML's recipe on Fashion-MNIST and the digits, 0.9 less than 0.01.
    alpha: float = opt(0.9, "weight of the private model's cross-entropy; 1 - alpha weighs its "
                       "KL to the meme model (the paper's 0.5: conf/fml-paper.toml; 1 = no "
                       "mutual learning, HtFLlib's default)", low=0.0, high=1.0)
    beta: float = opt(0.5, "weight of the meme model's cross-entropy; 1 - beta weighs its KL "
                      "to the private model", low=0.0, high=1.0)
    detach_partner: bool = opt(
        True, "each KL holds the partner's prediction constant (deep mutual learning); false "
        "= HtFLlib: both KL terms reach both models")
    kl: str = opt("batchmean", "KL reduction: 'batchmean' (the textbook batch mean) or 'mean' "
                  "(PyTorch's KLDivLoss default, HtFLlib: also divided by C)",
                  choices=("batchmean", "mean"))


METHOD = Method("a private model and a shared meme model (one architecture, averaged) "
                "trained by mutual learning: CE + KL to each other",
                strategy_class="FML", client_class="FMLClient",
                settings=FMLSettings, recipe={**HTFLLIB, "grad-clip": 10.0},
                payload_kinds=("model",),
                secure_aggregation="as-is")
