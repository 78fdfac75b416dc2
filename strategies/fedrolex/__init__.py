"""FedRolex's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``; the page: docs/fedrolex.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from strategies import Method
from strategies.heterofl import HeteroFLSettings


@dataclass(frozen=True)
class FedRolexSettings(HeteroFLSettings):
    """``fedrolex.*``: HeteroFL's settings (its rates, masked head, Scaler and statistics);
    only the index window differs. ``sbn = "none"`` is the code's evaluation with the test
    batches' own statistics; the default keeps HeteroFL's sBN."""

    index_scheme: ClassVar[str] = "rolling"


# FedRolex's README command and resnet_client.py: SGD lr 2e-4, momentum 0.9, weight decay 1e-3,
# a new optimizer each round, gradient-norm clip 1, batch 10, one local epoch; MultiStepLR
# factor 0.25 at rounds 800 and 1200 of 3,200 (CIFAR-10), i.e. at 0.25 and 0.375 of the run.
RECIPE = {"optimizer": "sgd", "lr": 2e-4, "momentum": 0.9, "weight-decay": 1e-3,
          "grad-clip": 1.0, "optimizer-state": "fresh", "batch-size": 10, "local-epochs": 1,
          "local-steps": 0, "lr-decay-at": "0.25,0.375", "lr-decay": 0.25}

METHOD = Method("HeteroFL's width slices, but each layer's kept channels are a window that "
                "rolls by one index per round, so every channel of the global model is trained "
                "equally often",
                strategy_class="FedRolex", client_class="FedRolexClient",
                settings=FedRolexSettings, recipe=RECIPE, payload_kinds=("sub-model",),
                secure_aggregation="fixed-layout")
