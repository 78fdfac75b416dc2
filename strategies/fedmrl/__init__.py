"""FedMRL's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import ConfigError, RunConfig, opt
from fedapp.runtime.recipes import HTFLLIB
from fedapp.runtime.two_model_settings import SharedModelSettings
from strategies import Method


HTFL_SHARED_DIM = 128  # HtFLlib's -sfd


@dataclass(frozen=True)
class FedMRLSettings(SharedModelSettings):
    """``fedmrl.*``: the shared representation's size, the projector's lifetime, evaluation."""

    shared_dim: int = opt(0, "s, the shared model's representation size and the Matryoshka "
                          "prefix its head reads (0 = HtFLlib's 128, or feature-dim when "
                          "smaller; the authors' code uses s = d)", low=0)
    keep_projector: bool = opt(
        True, "keep each client's projector across rounds (false = HtFLlib, which never saves "
        "it: it restarts from its initial weights every round)")
    eval_shared: str = opt(
        "local", "the shared extractor a client predicts with: 'local' (the one it trained "
        "last: the paper, the authors' code) or 'global' (the server's: HtFLlib)",
        choices=("local", "global"))
    shared_reduce: str = opt(
        "pool", "how the shared extractor's output becomes s long: 'pool' (the architecture "
        "built with its d, then averaged in s groups: HtFLlib's BaseHeadSplit, the spec) or "
        "'linear' (the architecture's last layer built s wide: fewer parameters, less "
        "traffic)", choices=("pool", "linear"))

    def shared_feature_dim(self, cfg: RunConfig) -> int:
        return self.shared_dim or min(HTFL_SHARED_DIM, cfg.feature_dim or HTFL_SHARED_DIM)

    def shared_pool_dim(self, cfg: RunConfig) -> int | None:
        return self.shared_feature_dim(cfg) if self.shared_reduce == "pool" else None

    def check(self, cfg: RunConfig) -> None:
        if cfg.feature_dim and self.shared_feature_dim(cfg) > cfg.feature_dim:
            raise ConfigError(f"setting fedmrl.shared-dim = {self.shared_dim} is invalid: the "
                              f"shared head reads a prefix of the d = feature-dim = "
                              f"{cfg.feature_dim} projected representation, so s <= d")
        super().check(cfg)  # builds the shared model


METHOD = Method("a shared small model beside each private one; a private projector fuses "
                "both features, the shared head reads its first s dimensions, the private "
                "head all (Matryoshka); the shared model is averaged",
                strategy_class="FedMRL", client_class="FedMRLClient",
                settings=FedMRLSettings, recipe=HTFLLIB,
                payload_kinds=("model",),
                secure_aggregation="as-is")
