"""FedHe's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import ConfigError, RunConfig, UploadLayout, opt
from strategies import Method


@dataclass(frozen=True)
class FedHeSettings:
    """``fedhe.*``: the logit loss, the client's per-class averages and the server store."""

    alpha: float = opt(1.0, "weight of the logit loss (paper: 1)", low=0.0)
    logit_loss: str = opt("mse", "distance to the server's class logits: 'mse' (code) or "
                          "'kl' (softmax with temperature)", choices=("mse", "kl"))
    temperature: float = opt(1.0, "KL logit loss: softmax temperature", low=0.0, low_open=True)
    plus_one: bool = opt(True, "divide logit sums by count + 1 (paper Eq. 8; false = by count)")
    history: str = opt("all", "server store: 'all' (paper), 'running-mean' (code), "
                       "'latest-per-client'", choices=("all", "running-mean", "latest-per-client"))
    collapse_every: int = opt(0, "running-mean: uploads between collapses (0 = 10 x num-clients)",
                              low=0)

    def check(self, cfg: RunConfig) -> None:
        # 'all' and 'running-mean' keep per-class sums, never a client's own rows, so no rule
        # can tell an attacker's logits apart; 'latest-per-client' keeps each client's rows.
        if cfg.robust_aggregation != "none" and self.history != "latest-per-client":
            raise ConfigError(
                f"setting robust-aggregation = {cfg.robust_aggregation!r} is invalid for "
                f"method 'fedhe' with fedhe.history = {self.history!r}: that store keeps only "
                "per-class sums, not each client's rows, which a robust rule needs; set "
                "fedhe.history = 'latest-per-client'.")

    def secure_aggregation_conflict(self, cfg: RunConfig) -> str | None:
        """Why these settings need individual uploads (None: exact from a round's sums)."""
        if self.history == "all":
            return None
        return (f"fedhe.history = {self.history!r}: the server sees only the sum of a round's "
                "uploads, and " + SECURE_REFUSED[self.history] + "; use fedhe.history = "
                "'all' (the paper's store, the default), which is per-class sums and counts")


# Why a store other than 'all' cannot be kept from the sums of a round's uploads.
SECURE_REFUSED = {
    "running-mean": "this store collapses its past into one vote after every "
                    "collapse-every-th upload, which may fall between two uploads of one sum",
    "latest-per-client": "this store replaces each client's vectors with its newest, and the "
                         "server holds a client's older vectors only inside a past round's "
                         "sum"}

# FedHe's code compiles one Keras Adam per client, kept for the whole run; 3 batches of 50.
RECIPE = {"optimizer": "adam", "lr": 0.001, "weight-decay": 0.0, "grad-clip": 0.0,
          "optimizer-state": "keep", "batch-size": 50, "local-steps": 3}

METHOD = Method("per-class average logits up and down; CE + alpha * logit loss "
                "(any architectures)",
                strategy_class="FedHe", client_class="FedHeClient", settings=FedHeSettings,
                asynchronous=True, recipe=RECIPE,
                payload_kinds=("class-rows",),
                secure_aggregation="fixed-layout",
                upload_layout=UploadLayout(labels="labels", rows=("logits",), logits=("logits",)))
