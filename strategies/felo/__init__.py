"""Felo's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import ConfigError, RunConfig, UploadLayout, opt, sampled_per_round
from strategies import Method


@dataclass(frozen=True)
class FeloSettings:
    """``felo.*``: the client loss, the local update, the server store and group averaging."""

    alpha: float = opt(0.5, "weight of the feature + logit distillation terms (code: 0.5; "
                       "the paper gives none)", low=0.0)
    logit_loss: str = opt("kl", "distance to the server's class logits: 'kl' (paper; server "
                          "softmax as the target) or 'mse' on raw logits (the authors' code)",
                          choices=("kl", "mse"))
    temperature: float = opt(1.0, "KL logit loss: softmax temperature T (loss scaled by T^2)",
                             low=0.0, low_open=True)
    warmup_fraction: float = opt(0.05, "first fraction of num-server-rounds trained with CE "
                                 "only, the server sending no tables (code: 5 % of the "
                                 "iterations)", low=0.0, high=1.0)
    # Off by default, by measurement (docs/felo.md, "Under sparse participation"): where a
    # client's group changes many times between two of its visits, installing the group's
    # model costs it what it learnt; the paper's setting is conf/felo-fmnist.toml's.
    group_avg: bool = opt(False, "FedAvg within each architecture group, weighted by n_k "
                          "(true = the paper, Sec. 3.1.2; false = the released code, which "
                          "skips it: the default, measured in docs/felo.md)")
    history: str = opt("fifo", "server store per class: 'fifo' (the last history-size entries "
                       "ever received) or 'latest-round' (only those of the latest round that "
                       "brought the class)", choices=("fifo", "latest-round"))
    history_size: int = opt(50, "entries kept per class by the server store", low=1)
    eval_model: str = opt("own", "model evaluated: the client's 'own' (after its last local "
                          "training) or its architecture 'group' average (needs group-avg)",
                          choices=("own", "group"))

    def check(self, cfg: RunConfig) -> None:
        if self.eval_model == "group" and not self.group_avg:
            raise ConfigError(f"setting {cfg.method}.eval-model = 'group' needs "
                              f"{cfg.method}.group-avg = true: without group averaging there "
                              "is no group model to evaluate.")

    def secure_aggregation_conflict(self, cfg: RunConfig) -> str | None:
        """Why these settings need individual uploads, which secure aggregation hides (None:
        the server's maths are exact from the round's sums)."""
        if self.history != "latest-round":
            return (f"{cfg.method}.history = {self.history!r}: its server averages each "
                    "class's last history-size entries across rounds, individual uploads "
                    "that a round's sum does not hold; use history = 'latest-round', whose "
                    "tables are the means of one round's entries")
        if sampled_per_round(cfg) > self.history_size:
            return (f"{cfg.method}.history-size = {self.history_size} below the "
                    f"{sampled_per_round(cfg)} clients of a round: the server would keep only "
                    "the last history-size of a class's entries, which a sum cannot single "
                    "out; raise history-size")
        return None

# Felo/Velo's code: one Adam per client with a MultiStepLR (x0.1 at half the run on
# Fashion-MNIST) kept for the whole run; 10 batches of 50 per update.
RECIPE = {"optimizer": "adam", "lr": 0.001, "weight-decay": 0.0, "grad-clip": 0.0,
          "lr-decay-at": "0.5", "lr-decay": 0.1, "optimizer-state": "keep", "batch-size": 50,
          "local-steps": 10}

METHOD = Method("per-class mean features and logits up, their per-class averages down; "
                "CE + alpha * (feature MSE + logit KL); with group-avg (the paper's), "
                "same-architecture models averaged too",
                strategy_class="Felo", client_class="FeloClient", shared_dim=True,
                settings=FeloSettings, recipe=RECIPE,
                payload_kinds=("group-model", "class-rows"),
                # history = "latest-round" only (FeloSettings.secure_aggregation_conflict).
                secure_aggregation="fixed-layout",
                upload_layout=UploadLayout(labels="class-labels",
                                           rows=("class-features", "class-logits"),
                                           logits=("class-logits",)))
