"""LG-FedAvg's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from fedapp.runtime.recipes import SGD_HALF
from strategies import Method


METHOD = Method("average only the shared head; extractors stay local",
                strategy_class="LgFedAvg", client_class="LgFedAvgClient", shared_dim=True,
                recipe={**SGD_HALF, "weight-decay": 0.0, "batch-size": 50},
                payload_kinds=("model",),
                secure_aggregation="as-is")
