"""FedRE's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import UploadLayout, opt
from fedapp.runtime.recipes import HTFLLIB
from strategies import Method


@dataclass(frozen=True)
class FedRESettings:
    """``fedre.*``: the server's head training (the code's -slr 0.01, -hbs 32, one epoch)."""

    server_lr: float = opt(0.01, "server head learning rate (-slr)", low=0.0, low_open=True)
    server_batch_size: int = opt(32, "entangled representations per server step (-hbs)", low=1)
    send_head: bool = opt(True, "send the server's head to the clients (false = the HtFLlib "
                          "variant of the release, which never sends it)")
    eval_head: str = opt("own", "headline prediction: the client's 'own' head after local "
                         "training (chosen by measurement, docs/recipes.md), or the local "
                         "extractor with the server's 'global' head, the method's inference "
                         "(both are reported)", choices=("global", "own"))


METHOD = Method("one random convex mix of the class prototypes with its soft label up; the "
                "server trains a global head on the mixes and sends it",
                strategy_class="FedRE", client_class="FedREClient", shared_dim=True,
                server_d="the server's head is Linear(d, C)",
                settings=FedRESettings, asynchronous=True,
                # The FedRE repository's lr (main.py: -lr 0.03) with HtFLlib's batches of 10,
                # not its -lbs 64, which leaves a client of a few hundred samples too few steps
                # to re-fit the head it installs every round (chosen by measurement,
                # docs/recipes.md; conf/fedre-code.toml keeps the repository's 64).
                recipe={**HTFLLIB, "lr": 0.03},
                payload_kinds=("server-training",),
                secure_aggregation=(
                    "its server trains on each client's individual random mixture and its soft "
                    "label"),
                upload_layout=UploadLayout(simplex=("weights",)))
