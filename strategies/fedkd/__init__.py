"""FedKD's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import ConfigError, RunConfig, opt
from fedapp.runtime.recipes import HTFLLIB
from fedapp.runtime.two_model_settings import SharedModelSettings
from strategies import Method


@dataclass(frozen=True)
class FedKDSettings(SharedModelSettings):
    """``fedkd.*``: the SVD energy schedule, what is compressed, the mentee's rate."""

    energy_start: float = opt(0.95, "SVD energy threshold T_start of the first round",
                              low=0.0, high=1.0, low_open=True)
    energy_end: float = opt(0.98, "SVD energy threshold T_end reached after the last round",
                            low=0.0, high=1.0, low_open=True)
    mentee_lr: float = opt(0.0, "the mentee's learning rate (0 = the recipe's lr)", low=0.0)
    compress: str = opt(
        "update", "what travels as SVD factors: 'update' (the mentee's update each way: the "
        "paper) or 'weights' (the mentee's weights each way: HtFLlib)",
        choices=("update", "weights"))
    rank_rule: str = opt(
        "energy", "'energy': the smallest rank holding the energy threshold, the full rank "
        "included; 'htfllib': its search, which never tries the full rank and sends a matrix "
        "needing it as zeros", choices=("energy", "htfllib"))
    codec: str = opt(
        "compact", "'compact': a convolution factored as out x in*k*k, a tensor whose factors "
        "would not be smaller sent exactly; 'htfllib': each k x k kernel factored on its own "
        "with one rank per layer, and factors sent even where larger",
        choices=("compact", "htfllib"))
    htfllib_loss: bool = opt(
        False, "HtFLlib's loss: neither partner held constant, S trained, the hidden term "
        "counted in both models' losses")
    kl: str = opt("batchmean", "KL reduction: 'batchmean' or 'mean' (KLDivLoss's default, "
                  "HtFLlib: also divided by C)", choices=("batchmean", "mean"))

    def check(self, cfg: RunConfig) -> None:
        super().check(cfg)
        if self.energy_end < self.energy_start:
            raise ConfigError(f"setting fedkd.energy-end = {self.energy_end} is invalid: the "
                              f"threshold rises from fedkd.energy-start = {self.energy_start}")


METHOD = Method("a private mentor and a shared mentee (averaged) by adaptive mutual "
                "distillation (KL + hidden MSE, scaled by the task losses); the mentee's "
                "updates travel as truncated SVD factors",
                strategy_class="FedKD", client_class="FedKDClient",
                settings=FedKDSettings, recipe={**HTFLLIB, "grad-clip": 10.0},
                payload_kinds=("model",),
                secure_aggregation=(
                    "its uploads are SVD factors of each update, which do not add up: the server "
                    "decompresses each one before averaging"))
