"""FedMD's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``; the page: docs/fedmd.md)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import ConfigError, RunConfig, opt
from strategies import Method, public_labels

PRETRAIN = ("none", "public", "public+private")


@dataclass(frozen=True)
class FedMDSettings:
    """``fedmd.*``: the alignment set, the digest and the transfer-learning phase."""

    alignment_size: int = opt(
        500, "public samples A_t scored per round, redrawn every round (the paper's "
        "N_alignment: 5000; 500 keeps a CPU round short)", low=1)
    digest_loss: str = opt(
        "mae", "distance of a model's logits to the consensus in the digest: 'mae' (the "
        "authors' code), 'mse' (FL-bench) or 'kl' (softmax of both, temperature 1)",
        choices=("mae", "mse", "kl"))
    digest_epochs: int = opt(
        1, "passes over A_t in the digest (code: 1); 0 = no digest, the consensus ignored: "
        "FedMD's transfer learning and revisits alone, the control that isolates what the "
        "collaboration adds", low=0)
    digest_batch_size: int = opt(256, "digest mini-batch (code: 256)", low=1)
    pretrain: str = opt(
        "public+private", "transfer learning before a client's first digest: on the labelled "
        "public set, then on its private data (the authors' code), 'public' only, or 'none'",
        choices=PRETRAIN)
    pretrain_public_epochs: int = opt(20, "most epochs on the public set (code: 20)", low=1)
    pretrain_public_batch_size: int = opt(128, "public pre-training batch (code: 128)", low=1)
    pretrain_public_patience: int = opt(
        3, "public pre-training: epochs without a 0.001 gain in held-out accuracy before it "
        "stops (code: 3)", low=1)
    pretrain_private_epochs: int = opt(25, "most epochs on the private data (code: 25)",
                                       low=1)
    pretrain_private_batch_size: int = opt(32, "private pre-training batch (code: 32)", low=1)
    pretrain_private_patience: int = opt(
        10, "private pre-training: epochs without a 0.001 gain in held-out accuracy before "
        "it stops (code: 10)", low=1)
    revisit_optimizer: str = opt(
        "own", "the revisit's Adam: 'own' starts at the first revisit and is kept from then "
        "on; 'private-pretraining' continues the one of the private pre-training, moments "
        "and step count (the authors' code compiles a party's model once, before that phase)",
        choices=("own", "private-pretraining"))
    early_stopping_fraction: float = opt(
        0.1, "share of the pre-training data (the public set; the client's training shard) "
        "held out to decide early stopping; the code monitors the TEST set, which this "
        "never does. 0 = no early stopping, every epoch runs", low=0.0, high=0.5)

    def public_per_round(self, cfg: RunConfig) -> int:
        """What the data set-up checks the public set against: A_t must fit in it."""
        return self.alignment_size

    def reads_public_labels(self, cfg: RunConfig) -> bool:
        return "public" in self.pretrain

    def check(self, cfg: RunConfig) -> None:
        if self.revisit_optimizer == "private-pretraining" and (
                self.pretrain != "public+private" or cfg.optimizer_state != "keep"):
            raise ConfigError(
                "setting fedmd.revisit-optimizer = 'private-pretraining' continues the "
                "optimizer of the private pre-training, which needs fedmd.pretrain = "
                f"'public+private' (not {self.pretrain!r}) and optimizer-state = 'keep' (not "
                f"{cfg.optimizer_state!r}); set fedmd.revisit-optimizer = 'own'.")
        if "public" not in self.pretrain:
            return
        if not public_labels(cfg):
            raise ConfigError(
                f"setting fedmd.pretrain = {self.pretrain!r} trains on the public labels, but "
                "public-labels = 'unlabelled'; set fedmd.pretrain = 'none' or public-labels = "
                "'labelled' (or 'method': FedMD's paper reads them).")
        if cfg.public_source == "digits":
            raise ConfigError(
                f"setting fedmd.pretrain = {self.pretrain!r} is invalid with public-source = "
                "'digits': its classes (the digits 0-9) are not the private data's, and the "
                "authors' answer, a model with |public| + |private| outputs, is not "
                "implemented here; set fedmd.pretrain = 'none' or public-source = "
                "'train-holdout'.")


# The authors' code (diogenes0319/FedMD_clean, FEMNIST conf): Keras Adam 1e-3, one optimizer
# for the revisit kept for the whole run (another for the digest, same recipe), no weight
# decay or clipping; revisit = N_private_training_round = 2 epochs in batches of 5.
RECIPE = {"optimizer": "adam", "lr": 0.001, "weight-decay": 0.0, "grad-clip": 0.0,
          "optimizer-state": "keep", "batch-size": 5, "local-epochs": 2, "local-steps": 0}

METHOD = Method("model distillation on a public set: logits on A_t up, their mean down; each "
                "client digests it (MAE) and revisits its private data (any architectures)",
                strategy_class="FedMD", client_class="FedMDClient", settings=FedMDSettings,
                recipe=RECIPE, needs_public=True, public_labels=True,
                # Its server averages same-shaped tables (logits of A_t): a model-like payload.
                payload_kinds=("model",),
                secure_aggregation="as-is")
