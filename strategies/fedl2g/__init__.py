"""FedL2G's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedapp.config import ConfigError, RunConfig, UploadLayout, opt
from fedapp.runtime.recipes import HTFLLIB
from strategies import Method


# FedL2G's run_me.sh: the server's step size per variant.
SERVER_LR = {"feat": 100.0, "logit": 0.1}


@dataclass(frozen=True)
class FedL2GSettings:
    """``fedl2g.*``."""

    variant: str = opt("feat", "what the guiding vectors guide: the features ('feat', m = d; "
                       "one d for every client) or the logits ('logit', m = C)",
                       choices=("feat", "logit"))
    warmup_fraction: float = opt(
        0.025, "first fraction of num-server-rounds (rounded down) with meta steps only, no "
        "local training and no evaluation (HtFLlib: 50 of its 2000 rounds)", low=0.0,
        high=1.0)
    study_batches: int = opt(1, "study batches in the look-ahead step (mdb)", low=1)
    quiz_batches: int = opt(1, "quiz batches (mqb); the quiz set is quiz-batches * batch-size "
                            "training samples, held out from training", low=1)
    quiz_set: str = opt(
        "random", "which training samples the quiz set holds: a seeded 'random' draw, or the "
        "'first' ones in the data's order, the study set keeping that order (HtFLlib, which "
        "slices its stored per-client file)", choices=("random", "first"))
    server_lr: float = opt(0.0, "server step size eta_s on the guiding vectors (0 = FedL2G's "
                           "run_me.sh: 100 for feat, 0.1 for logit; HtFLlib's main.py 0.01)",
                           low=0.0)
    guide_seed: int = opt(
        -1, "the guiding vectors' initial draw: -1 = keyed by the run's seed; s >= 0 = "
        "N(0, 1) from a torch generator seeded with s, for every run (HtFLlib builds its "
        "nn.Embedding after its last client re-seeds torch with 0: its guide is s = 0 in "
        "every run)", low=-1)

    def warmup_rounds(self, num_server_rounds: int) -> int:
        """wu: the warm-up's rounds, which count toward the run's rounds."""
        return math.floor(self.warmup_fraction * num_server_rounds)

    def check(self, cfg: RunConfig) -> None:
        if self.warmup_rounds(cfg.num_server_rounds) >= cfg.num_server_rounds:
            raise ConfigError(
                f"setting fedl2g.warmup-fraction = {self.warmup_fraction} is invalid with "
                f"num-server-rounds = {cfg.num_server_rounds}: the warm-up would take every "
                "round, so no client would ever train. Set a smaller fraction.")
        from fedapp.data.setup import architectures  # the models import torch
        if self.variant == "feat" and cfg.feature_dim == 0 \
                and len(set(architectures(cfg))) > 1:
            raise ConfigError(
                "setting fedl2g.variant = 'feat' guides the features, so every extractor must "
                "output the same dimension: set feature-dim > 0 or use variant 'logit'.")

    def eta_s(self) -> float:
        return self.server_lr or SERVER_LR[self.variant]


METHOD = Method("learnable per-class guiding vectors (features or logits) the server updates "
                "with the clients' meta-gradients of a held-out quiz loss; CE + MSE to them",
                strategy_class="FedL2G", client_class="FedL2GClient", settings=FedL2GSettings,
                recipe={**HTFLLIB, "grad-clip": 100.0},
                payload_kinds=("class-rows",),
                secure_aggregation="fixed-layout",
                upload_layout=UploadLayout(labels="labels", rows=("meta-gradients",)))
