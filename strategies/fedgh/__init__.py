"""FedGH's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import UploadLayout, opt
from strategies import Method


@dataclass(frozen=True)
class FedGHSettings:
    """``fedgh.*``: the server's header training (paper: SGD, eta_g = 0.01, one pass)."""

    server_lr: float = opt(0.01, "server header learning rate eta_g", low=0.0, low_open=True)
    server_epochs: int = opt(1, "passes over the round's LARs per round", low=1)
    server_batch_size: int = opt(
        0, "LARs per server step (0 = all LARs of one client per step, as they arrive)", low=0)
    client_order: str = opt("shuffled", "order in which clients' LARs are consumed: 'shuffled' "
                            "(seeded, like arrival order), 'partition' (by partition id), or "
                            "'pooled': every client's LARs shuffled together into batches of "
                            "server-batch-size (HtFLlib's server DataLoader)",
                            choices=("shuffled", "partition", "pooled"))
    server_head_training: bool = opt(
        True, "train the global header (false = the released code's frozen random header)")


METHOD = Method("server trains a global header on clients' per-class averaged "
                "representations",
                strategy_class="FedGH", client_class="FedGHClient", shared_dim=True,
                server_d="the global header is Linear(d, C)",
                settings=FedGHSettings,
                # The heterogeneous script's SGD, new for every client and round, and five
                # local epochs of 64: the paper grid-searches E in 1..100 and B in 32..512 (its
                # script trains 30 of 512); with one epoch a client of a few hundred samples
                # has 5 steps a round to re-fit the global header it installs, and FedGH lost
                # to local training at its recipe (chosen by measurement, docs/recipes.md).
                recipe={"optimizer": "sgd", "lr": 0.01, "momentum": 0.9,
                        "weight-decay": 0.001, "grad-clip": 50.0,
                        "optimizer-state": "fresh", "local-epochs": 5},
                payload_kinds=("server-training",),
                secure_aggregation=("its server trains the global header by SGD on the individual "
                                    "(representation, label) pairs, client by client"),
                upload_layout=UploadLayout(labels="labels", rows=("representations",)))
