"""FedMRL, federated model-heterogeneous Matryoshka representation learning (Yi et al.,
NeurIPS 2024): a small shared model runs beside each private one, a private projector fuses
their features, the shared head reads a Matryoshka prefix and the private head the whole.

Client i holds its private model (extractor f_i with output d, head h_i = Linear(d, C)), a copy
of the shared model psi (extractor g with output s, head h_psi = Linear(s, C); one architecture
for everyone, built with feature-dim and its output average-pooled to s as HtFLlib builds it,
``fedmrl.shared-reduce``; ``fedapp.runtime.two_models``) and a private projector
P_i = Linear(s + d, d). On each batch

    r = P_i [g(x); f_i(x)]                       (the shared part first)
    L = CE(h_i(r), y) + CE(h_psi(r[:s]), y)      (one backward pass)

trains f_i, h_i, P_i and psi together. psi starts every round from the server's copy; the
server averages the uploaded psi (weighted by training-set size). A client predicts with
h_i(P_i [g(x); f_i(x)]), g from the psi it trained last (the paper and the authors' code, which
evaluate after local training; ``fedmrl.eval-shared = "global"``: g of the server's psi, as
HtFLlib, which then sends psi for evaluation too). The whole psi travels each way.

HtFLlib's ``clientmrl`` never saves P_i, so its projector restarts from its initial weights
every round (HtFLlib #15): ``fedmrl.keep-projector = false`` reproduces that.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from fedapp.config import ConfigError
from fedapp.runtime.client_base import load_arrays
from fedapp.runtime.payload import Payload
from fedapp.runtime.strategy_base import ClientInfo
from fedapp.runtime.two_models import SharedModelStrategy, TwoModelClient


class MatryoshkaPredictor(torch.nn.Module):
    """h_i(P_i [g(x); f_i(x)]): how a FedMRL client predicts."""

    def __init__(self, shared_extractor: torch.nn.Module, extractor: torch.nn.Module,
                 projector: torch.nn.Module, head: torch.nn.Module) -> None:
        super().__init__()
        self.shared_extractor, self.extractor = shared_extractor, extractor
        self.projector, self.head = projector, head

    def represent(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(torch.cat([self.shared_extractor(x), self.extractor(x)], dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.represent(x))


def matryoshka_loss(predictor: MatryoshkaPredictor, shared_head: torch.nn.Module,
                    x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """CE(h_i(r), y) + CE(h_psi(r[:s]), y), r the projected representation."""
    r = predictor.represent(x)
    return (F.cross_entropy(predictor.head(r), y)
            + F.cross_entropy(shared_head(r[:, :shared_head.in_features]), y))


class FedMRLClient(TwoModelClient):
    """Installs psi, trains psi, its own model and its projector on the Matryoshka loss,
    uploads psi."""

    def private_modules(self) -> dict[str, Callable[[], torch.nn.Module]]:
        s, d = self.shared.feature_dim, self.model.feature_dim
        if s > d:
            raise ConfigError(f"FedMRL's shared representation (s = {s}) must not be longer "
                              f"than the private one of {self.arch} (d = {d}): set "
                              "fedmrl.shared-dim or feature-dim")
        return {"projector": lambda: torch.nn.Linear(s + d, d)}

    def keep_module(self, name: str) -> bool:
        return self.cfg.settings.keep_projector

    def predictor(self) -> MatryoshkaPredictor:
        return MatryoshkaPredictor(self.shared.extractor, self.model.extractor,
                                   self.modules["projector"], self.model.head)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return matryoshka_loss(self.predictor(), self.shared.head, x, y)

    def receive_for_evaluation(self, payload: Payload) -> bool:
        if payload:  # eval-shared = "global": predict with the server's psi (never kept)
            load_arrays(self.shared, payload)
        return False  # the private model itself is unchanged


class FedMRL(SharedModelStrategy):
    """Sends psi; averages the uploaded ones; with eval-shared = "global" sends it for
    evaluation too."""

    def eval_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        return self.shared_model if self.cfg.settings.eval_shared == "global" else {}
