"""FedRep's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import opt
from fedapp.runtime.recipes import SGD_HALF
from strategies import Method


@dataclass(frozen=True)
class FedRepSettings:
    """``fedrep.*``: the head phase before the extractor phase."""

    head_epochs: int = opt(10, "epochs of head training (extractor frozen) before the "
                           "extractor epochs (FedRep paper: 10)", low=1)


METHOD = Method("as fedper, trained head first (extractor frozen), then extractor (head "
                "frozen)",
                strategy_class="FedRep", client_class="FedRepClient", settings=FedRepSettings,
                recipe={**SGD_HALF, "weight-decay": 0.0001, "batch-size": 10},
                payload_kinds=("group-model",),
                # As fedper: a table of every architecture's extractor.
                secure_aggregation="fixed-layout")
