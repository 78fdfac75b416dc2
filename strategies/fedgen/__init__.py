"""FedGen's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import opt
from fedapp.runtime.recipes import HTFLLIB
from strategies import Method


# The authors' code never lets the client-term weight decay below this.
MIN_CLIENT_WEIGHT = 1e-4


@dataclass(frozen=True)
class FedGenSettings:
    """``fedgen.*``: the generator, its server training and the client's generator term."""

    noise_dim: int = opt(32, "generator noise size nd (HtFLlib's total.sh: 32; main.py 512)",
                         low=1)
    hidden_dim: int = opt(512, "generator hidden width hd", low=1)
    # HtFLlib's main.py rate, chosen by measurement over its total.sh's 0.1, at which the
    # generator never fits the heads' ensemble (docs/fedgen.md, "The generator's learning rate").
    server_lr: float = opt(0.005, "generator Adam learning rate (HtFLlib's main.py: 0.005; "
                           "total.sh 0.1)", low=0.0, low_open=True)
    server_steps: int = opt(100, "generator Adam steps per round (HtFLlib's server_epochs)",
                            low=1)
    server_batch_size: int = opt(0, "labels per generator step (0 = the run's batch-size, as "
                                 "HtFLlib)", low=0)
    noise: str = opt("normal", "generator noise eps: 'normal' N(0, I) (paper) or 'uniform' "
                     "U[0, 1) (HtFLlib's code)", choices=("normal", "uniform"))
    teacher_weights: str = opt(
        "label", "weights of the heads in the teacher ensemble: 'label' = n_k^y / sum_j n_j^y "
        "per label y (paper), 'samples' = n_k / sum_j n_j per client (HtFLlib)",
        choices=("label", "samples"))
    diversity: float = opt(1.0, "weight of the generator's diversity regulariser (paper; "
                           "authors' code 1; HtFLlib 0)", low=0.0)
    client_weight: float = opt(10.0, "weight alpha_0 of the client's generator term (authors' "
                               "code 10; HtFLlib 1)", low=0.0)
    client_weight_decay: float = opt(
        0.98, "alpha_t = max(1e-4, alpha_0 * decay^(t - 1)) in round t (authors' code 0.98; "
        "HtFLlib 1 = constant)", low=0.0, high=1.0, low_open=True)
    keep_generator: bool = opt(
        True, "keep the generator the server trains (paper, authors' code); false = HtFLlib's "
        "code, whose server trains a copy of its initial generator each round and discards it, "
        "so that the clients always draw from the untrained G")
    label_pool: str = opt(
        "uploads", "where the server learns the clients' label histograms: 'uploads' = each "
        "client's first upload, so G is first sent in round 2 (a federation's only way); "
        "'partition' = computed by the server from the run's partition before round 1, so the "
        "clients use G from round 1 (HtFLlib's code, whose server reads every client's labels "
        "at start-up); a node training on its own data still uploads its histogram",
        choices=("uploads", "partition"))

    def client_term_weight(self, server_round: int) -> float:
        """alpha_t for round ``server_round`` (1-based; the authors count from 0)."""
        decayed = self.client_weight * self.client_weight_decay ** max(server_round - 1, 0)
        return max(min(self.client_weight, MIN_CLIENT_WEIGHT), decayed)


METHOD = Method("heads averaged; the server trains a feature generator on the ensemble of "
                "the heads, and clients train their heads on its features too",
                strategy_class="FedGen", client_class="FedGenClient", shared_dim=True,
                settings=FedGenSettings, recipe=HTFLLIB,
                # The heads are the generator's teachers and are averaged: a robust rule
                # filters them, and both use the kept heads (FedStrategy.teachers).
                payload_kinds=("teachers",),
                # Heads are linear: each label's teacher ensemble is one head, a weighted sum.
                secure_aggregation="fixed-layout")
