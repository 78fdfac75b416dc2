"""Standalone: every client trains its own model on its own data; nothing is communicated.

The lower bound every paper reports ("Standalone" in FedGH, "Private" in FedHe, "local
training" in FedClassAvg): whatever a method gains over it is what collaboration buys.
"""

from fedapp.runtime.client_base import FedClient
from fedapp.runtime.strategy_base import FedStrategy


class StandaloneClient(FedClient):
    """Cross-entropy on local data; receives and uploads nothing."""


class Standalone(FedStrategy):
    """Sends nothing, aggregates nothing; only schedules training and evaluation."""
