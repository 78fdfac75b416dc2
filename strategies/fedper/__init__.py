"""FedPer's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from fedapp.runtime.recipes import SGD_HALF
from strategies import Method


METHOD = Method("average the extractors within each architecture; heads stay private",
                strategy_class="FedPer", client_class="FedPerClient",
                recipe={**SGD_HALF, "weight-decay": 0.0001, "batch-size": 10},
                payload_kinds=("group-model",),
                # With secure-aggregation: a table of every architecture's extractor,
                # its own in its slot (docs/privacy.md).
                secure_aggregation="fixed-layout")
