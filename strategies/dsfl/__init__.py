"""DS-FL's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``; the page: docs/dsfl.md)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import RunConfig, UploadLayout, opt
from strategies import Method

AGGREGATIONS = ("era", "sa")


@dataclass(frozen=True)
class DSFLSettings:
    """``dsfl.*``: the open set per round, the aggregation and the distillation (clients' and
    the server model's)."""

    open_size: int = opt(
        500, "unlabelled open (public) samples scored per round, redrawn every round "
        "(SCARLET's public_size_per_round: 1000; 500 keeps a CPU round short)", low=1)
    aggregation: str = opt(
        "era", "how the server combines the clients' probabilities per open sample: 'era' "
        "(entropy-reduction averaging, softmax(mean / temperature): the paper's method) or "
        "'sa' (simple averaging, the paper's ablation)", choices=AGGREGATIONS)
    temperature: float = opt(
        0.1, "ERA's softmax temperature T (< 1 sharpens; T = 1 would flatten a probability "
        "vector)", low=0.0, low_open=True)
    kd_epochs: int = opt(5, "distillation passes over the open samples, a client's and the "
                         "server model's (SCARLET: 5)", low=1)
    kd_batch_size: int = opt(100, "distillation mini-batch (SCARLET reproducibility: 100)",
                             low=1)
    kd_lr: float = opt(0.1, "distillation learning rate, a client's (the recipe's optimizer) "
                       "and the server model's (SGD) (SCARLET: 0.1)", low=0.0, low_open=True)
    server_arch: str = opt(
        "", "the server model's architecture (a zoo name); '' = the run's largest "
        "architecture by parameter count (the first of arch-mix on a tie), the clients' own "
        "one in a one-architecture run as in SCARLET")

    def public_per_round(self, cfg: RunConfig) -> int:
        """What the data set-up checks the public set against: the open subset must fit."""
        return self.open_size


# SCARLET (kitsuyaazuma/SCARLET @bd433de, algorithm/dsfl.py, reproducibility conf): the private
# update is `epochs` 5 in batches of 100 with SGD lr 0.1 (no momentum or weight decay), its
# optimizer kept for the client's life (plain SGD keeps no state: the same as a fresh one).
RECIPE = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "weight-decay": 0.0,
          "grad-clip": 0.0, "optimizer-state": "keep", "batch-size": 100, "local-epochs": 5,
          "local-steps": 0}

METHOD = Method("distillation-based semi-supervised FL: probabilities on an unlabelled open "
                "subset up, their entropy-reduced average (ERA) down; clients and a server "
                "model distil on it (any architectures)",
                strategy_class="DSFL", client_class="DSFLClient", settings=DSFLSettings,
                recipe=RECIPE, needs_public=True, public_labels=False,
                # Its server averages same-shaped tables (probabilities on the open subset),
                # as FedMD's logits: a model-like payload, whose robust rules apply.
                payload_kinds=("model",),
                secure_aggregation="as-is",
                # Every row is a probability vector, which the server checks (non-negative,
                # summing to 1): value attacks act on its logarithm and put it back on the
                # simplex, so that it stays well-formed (fedapp.runtime.attacks).
                upload_layout=UploadLayout(simplex=("probabilities",)))
