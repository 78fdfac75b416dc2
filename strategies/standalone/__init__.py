"""Standalone's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from strategies import Method


METHOD = Method("local training only; no communication (lower bound)",
                strategy_class="Standalone", client_class="StandaloneClient",
                asynchronous=True,
                # Local training has no message boundary: one optimizer throughout.
                recipe={"optimizer-state": "keep"},
                secure_aggregation="its clients upload nothing: there is no sum to protect")
