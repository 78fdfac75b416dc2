"""FjORD (Horváth, Laskaridis et al., "FjORD: Fair and Accurate Federated Learning under
heterogeneous targets with Ordered Dropout", NeurIPS 2021): nested leading-channel sub-models
trained with ordered dropout.

Client k of tier p_max (``fjord.rates``) receives the leading ⌈p_max·w⌉ channels of every
hidden layer (the base's ``leading`` slices, HeteroFL's client: ``strategies.heterofl.maths``)
and, for every width p of P (``fjord.widths``) up to p_max, that width's BatchNorm statistics.
Each mini-batch it draws a width p uniformly from {p ∈ P : p ≤ p_max} and trains the leading
⌈p·w⌉ channels of every layer at once (``client_models.width.set_width``: views of its own
weights, so one optimizer updates every width); each width has its own affine-free BatchNorm
statistics, with one shared affine sliced (Flower's ``ODBatchNorm2d``). Plain cross-entropy:
no label mask, no Scaler; with ``fjord.kd``, self-distillation from the p_max output
(:func:`self_distillation`). It uploads its whole slice, statistics included.

Server (Flower's ``strategy.fjord_average``): for p from 1 down to the smallest width, the
slice [:⌈p·w_out⌉, :⌈p·w_in⌉] becomes the n_k-weighted mean of the uploads of the clients with
p_max ≥ p; that is the base's coordinate average weighted by n_k (each coordinate over the
clients whose slice holds it). Width p's statistics are averaged over the clients with
p_max ≥ p, who alone hold them.

Evaluation: the global model at **each** width of P on the global test set (``server_accuracy``
``width-<p>``, the paper's), and each client's own slice at its p_max on its local test.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from client_models.width import set_width
from fedapp.runtime.client_base import FedClient, load_arrays
from fedapp.runtime.strategy_base import ClientInfo, Upload
from fedapp.runtime.submodels import CoordinateAverage
from fedapp.runtime.training import TrainStats
from fedapp.seeding import derive_seed
from strategies.fjord import FjORDSettings
from strategies.heterofl.maths import HeteroFL, SubmodelClient, width_model


def draw_widths(rng: np.random.Generator, widths: tuple[Fraction, ...], p_max: Fraction,
                count: int) -> list[Fraction]:
    """``count`` widths drawn uniformly from {p ∈ widths : p ≤ p_max} (FjORD's ODSampler)."""
    allowed = [p for p in widths if p <= p_max]
    return [allowed[i] for i in rng.integers(len(allowed), size=count)]


def self_distillation(full: torch.Tensor, partial: torch.Tensor, y: torch.Tensor,
                      alpha: float, temperature: float) -> torch.Tensor:
    """One batch's loss with self-distillation, from the client's outputs at p_max (``full``)
    and at the sampled width (``partial``): CE(full, y), plus the sampled width's
    (1 - alpha) CE(partial, y) + alpha T^2 CE(partial / T, softmax(full / T)), the target
    detached. At alpha = 1, T = 1 it is Flower's ``models.train`` with knowledge distillation,
    whose two backward passes (``full_loss``, then ``partial_loss`` against
    ``full_output.detach().softmax(dim=1)``) add up to this sum's gradient."""
    t = temperature
    soft = F.softmax(full.detach() / t, 1)
    distilled = F.cross_entropy(partial / t, soft) * t * t
    return (F.cross_entropy(full, y) + (1 - alpha) * F.cross_entropy(partial, y)
            + alpha * distilled)


class FjORDClient(SubmodelClient):
    """HeteroFL's client (its slice, built at its width) trained with ordered dropout."""

    def train(self, server_round: int) -> TrainStats:
        s: FjORDSettings = self.cfg.settings
        self._sampler = (np.random.default_rng(
            derive_seed(self.cfg.seed, "fjord-width", self.partition_id, server_round)),
            s.width_set())
        try:
            return super().train(server_round)
        finally:
            set_width(self.model, None)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        rng, widths = self._sampler
        p = draw_widths(rng, widths, self.rate, 1)[0]
        s: FjORDSettings = self.cfg.settings
        full = None
        if s.kd:  # the p_max output first, as the baseline (its width's statistics too)
            set_width(self.model, None)
            full = self.model(x)
        set_width(self.model, p if p < self.rate else None)
        partial = self.model(x)
        if full is None:
            return F.cross_entropy(partial, y)
        return self_distillation(full, partial, y, s.kd_alpha, s.kd_temperature)

    def predictor(self) -> nn.Module:
        return self.model  # at p_max, with p_max's running statistics

    def evaluation_variants(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        return {}

    # With secure aggregation: the whole head, weighted by n_k (FjORD.aggregate).
    def head_rows(self) -> np.ndarray | None:
        return None

    secure_weight = FedClient.secure_weight  # n_k / S: the base's, not HeteroFL's 1


class FjORD(HeteroFL):
    """HeteroFL's server with FjORD's sample-weighted, label-blind average."""

    def label_rows(self, client: ClientInfo) -> np.ndarray | None:
        return None  # FjORD's head is averaged whole

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        total = CoordinateAverage(self.global_model, self.robust)
        for upload in uploads:
            total.add(upload.payload, self.maps(upload.client.partition_id, server_round),
                      weight=upload.num_examples)
        self.global_model = total.result()

    def global_predictor(self) -> nn.Module:
        if self._predictor is None or self._predictor[0] is not self.global_model:
            model = width_model(self.cfg, Fraction(1), self.input_shape, self.num_classes)
            load_arrays(model, self.global_model)
            self._predictor = (self.global_model, model.eval())
        return self._predictor[1]

    @torch.no_grad()
    def server_predict(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        model, out = self.global_predictor(), {}
        for p in self.settings.width_set():
            set_width(model, p if p < 1 else None)
            out[f"width-{float(p):g}"] = model(x)
        set_width(model, None)
        return out
