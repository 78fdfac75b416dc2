"""FedRep (Collins et al., ICML 2021): FedPer's sharing with alternating local training.

Like FedPer, the extractor ("representation") is shared and averaged within each architecture,
and the head stays private. Locally, a client first trains its head for ``fedrep.head-epochs``
epochs with the freshly installed global extractor frozen (FedRep paper: 10), then the
extractor for ``local-epochs`` epochs with the head frozen (paper: 1), and uploads the
extractor. Traffic is FedPer's: the extractor's parameters each way.
"""

from __future__ import annotations

import torch

from fedapp.runtime.training import TrainStats, train_recipe
from strategies.fedper.maths import FedPer, FedPerClient


class FedRepClient(FedPerClient):
    """Head epochs with the extractor frozen, then ``local-epochs`` with the head frozen."""

    def train(self, server_round: int) -> TrainStats:
        self.train_head(server_round)
        # Then the base's extractor epochs, with the head frozen (this optimizer holds only the
        # extractor's parameters, so the head cannot move).
        try:
            self.model.head.requires_grad_(False)
            return super().train(server_round)
        finally:
            self.model.head.requires_grad_(True)  # the cached model must not stay frozen

    def train_head(self, server_round: int) -> None:
        """``fedrep.head-epochs`` epochs of the head, the installed extractor frozen."""
        c, model = self.cfg, self.model
        model.extractor.requires_grad_(False)
        train_recipe(model, self.data.train_x, self.data.train_y, loss_fn=self.loss,
                     optimizer=super().optimizer(model.head.parameters(), "head"), cfg=c,
                     epochs=c.settings.head_epochs,
                     generator=self.batch_generator(server_round, "fedrep-head"))
        model.extractor.requires_grad_(True)

    def optimizer(self, params=None, name: str = "model", lr: float | None = None
                  ) -> torch.optim.Optimizer:
        # The base's training is the extractor phase: its optimizer holds the extractor only.
        if params is None:
            params, name = self.model.extractor.parameters(), "extractor"
        return super().optimizer(params, name, lr)


class FedRep(FedPer):
    """FedPer's server: extractors averaged within each architecture."""
