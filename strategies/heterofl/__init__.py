"""HeteroFL's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``; the page: docs/heterofl.md)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from fedapp.config import opt
from fedapp.runtime.submodel_settings import SubmodelSettings
from strategies import Method


@dataclass(frozen=True)
class HeteroFLSettings(SubmodelSettings):
    """``heterofl.*``: the sub-model kit's global model and rates, and HeteroFL's choices."""

    mask: bool = opt(
        True, "the label-split head (the code's mask = 1): a client's cross-entropy sets the "
        "logits of classes it has no samples of to 0, and the server averages each row of the "
        "head over the clients holding that class only")
    scaler: bool = opt(True, "the Scaler module: a sub-model of rate r divides its activations "
                       "by r while training (the code's scale = 1)")
    sbn: str = opt(
        "server-pool", "statistics of the static BatchNorms for evaluation: 'server-pool' (the "
        "code: the global model forwards the pooled training set of every client, cumulative "
        "average; a client's slice its own training data) or 'none' (evaluate with the test "
        "batch's own statistics, FedRolex's code)", choices=("server-pool", "none"))

    def model_options(self, rate: Fraction) -> dict:
        return {"norm": "static", "scaler": self.scaler}


# HeteroFL's code for MNIST/FMNIST's conv (utils.process_control, train_classifier_fed.py):
# SGD lr 0.01, momentum 0.9, weight decay 5e-4, 5 local epochs of batch 10, gradient-norm clip
# 1, a new optimizer each round; MultiStepLR factor 0.1 at round 100 of 200 (IID).
RECIPE = {"optimizer": "sgd", "lr": 0.01, "momentum": 0.9, "weight-decay": 5e-4,
          "grad-clip": 1.0, "optimizer-state": "fresh", "batch-size": 10, "local-epochs": 5,
          "local-steps": 0, "lr-decay-at": "0.5", "lr-decay": 0.1}

METHOD = Method("clients train width slices (the leading ⌈r·w⌉ channels of every layer) of one "
                "global model; each coordinate is averaged over the clients holding it",
                strategy_class="HeteroFL", client_class="SubmodelClient",
                settings=HeteroFLSettings, recipe=RECIPE, payload_kinds=("sub-model",),
                secure_aggregation="fixed-layout")
