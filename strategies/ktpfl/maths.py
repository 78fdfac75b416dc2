"""KT-pFL (Zhang et al., NeurIPS 2021): parameterized knowledge transfer for
personalised federated learning.

Every party holds the same public set P (``public-source``, read without its labels); nothing
of a model travels, so any architecture with the same C outputs takes part. Where FedMD sends
every client the same consensus, KT-pFL's server keeps an N x N *knowledge-coefficient matrix*
c (row i: how much client i learns from each client j, initialised to 1/N) and sends client i
its own target, the mix of everyone's soft predictions by its row. The round of the authors'
code (cugzj/KT-pFL @a08a01f, ``src/engine_kt_pfl.py``), which this follows:

1. *predict*: each client scores the alignment set A_t (``ktpfl.alignment-size`` public
   samples, redrawn every round) in eval mode as soft predictions p_k = softmax(o_k / T),
   T = 10, and uploads them;
2. *coefficients* (:func:`update_coefficients`): for each row i, one gradient step on
   L_i(c_i) = mean_{x,c} (p_i - sum_j c_ij p_j)^2 + rho * mean_j (c_ij - 1/N)^2
   (PyTorch's MSELoss, mean reduction, rho = ``ktpfl.penalty`` = 1), with the code's step size
   (:func:`code_step_size`), then the row is re-normalised as softmax(5 * c_i);
3. *targets* (:func:`personalised_target`): client i's target is sum_j c_ij p_j (a probability
   vector per sample, its own prediction included);
4. *distil*: each client fits its target on A_t, KL(target || softmax(o / T)) with PyTorch's
   element-mean reduction (1/C of the batch mean, no T^2), ``ktpfl.kd-epochs`` = 1 pass in
   shuffled batches of 256, a new SGD 0.02;
5. *local training*: cross-entropy on its private data, a new SGD 0.02 in batches of 16, for
   min(r, 10) epochs in the code's round r (the recipe's ``local-epochs``, ramped up:
   ``ktpfl.epoch-ramp``).

A Flower round is one message each way, so the steps are laid across rounds as FedMD's are:
round t's message carries client i's target on A_{t-1} with A_{t-1}'s indices; the client
distils, trains, then scores A_t, which it draws itself from the generator keyed by
``(seed, "ktpfl-alignment", t)`` (:func:`alignment_set`) as the server does. Round 1 is the
code's model initialisation (``ktpfl.init-epochs`` = 1 private epoch) and its first predictions;
Flower round t >= 2 is the code's round t - 1. Round t costs a client down m int32 indices +
m*C float32 targets (nothing in round 1), up m*C float32 soft predictions.

The code has every party in every round. Here a round's senders S are whoever the round's
accepted uploads come from: the step is the code's step with S as the federation (the
sub-matrix c[S, S], its rows re-normalised to sum to 1, uniform 1/|S|, the softmax over S);
the coefficients outside it stay as they were; and any client's target mixes the last
senders' predictions by its stored row over S, re-normalised to sum to 1 (with every client
in every round: exactly the code's). With ``robust-aggregation`` set, the rule first filters
the round's prediction tables (:meth:`~fedapp.runtime.strategy_base.FedStrategy.teachers`),
and S is the kept uploads' senders: a dropped upload counts as not sent.
"""

from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F

from fedapp.data import setup
from fedapp.data.public import round_subset
from fedapp.runtime.client_base import FedClient
from fedapp.runtime.payload import ArraySpec, Payload
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload
from fedapp.runtime.training import TrainStats, train_epochs, train_recipe
from strategies.dsfl.maths import check_probabilities, distillation_loss, probabilities
from strategies.ktpfl import KTpFLSettings

# The code's step-size rule: how far a row's mean |gradient| is driven, by factors of 5.
STEP_TARGET = 0.01
STEP_FACTOR = 5.0
STEP_TRIES = 5


def alignment_set(seed: int, server_round: int, public_size: int,
                  settings: KTpFLSettings) -> np.ndarray:
    """The round's A_t, keyed by ``(seed, "ktpfl-alignment", round)``."""
    return round_subset(seed, "ktpfl-alignment", server_round, public_size,
                        settings.alignment_size, replace=settings.alignment_replacement)


# -- the server's step ---------------------------------------------------------------------------

def code_step_size(mean_abs_gradient: float) -> float:
    """The step size the code gives a row whose gradient has mean absolute value g: starting
    at 1, five times over, divide g and the step by 5 while g > 0.01, and multiply both by 5
    when g < 0.01 (both tests in each pass, in that order: a g within (0.01, 0.05] is divided
    and multiplied back). The step lands g * step in about [0.01, 0.05)."""
    g, step = float(mean_abs_gradient), 1.0
    for _ in range(STEP_TRIES):
        if g > STEP_TARGET:
            g, step = g / STEP_FACTOR, step / STEP_FACTOR
        if g < STEP_TARGET:
            g, step = g * STEP_FACTOR, step * STEP_FACTOR
    return step


def coefficient_gradient(coefficients: np.ndarray, predictions: np.ndarray,
                         penalty: float) -> np.ndarray:
    """dL_i/dc_ij for every row i of ``coefficients`` [S, S], with ``predictions`` [S, m, C]:
    L_i = mean (p_i - sum_j c_ij p_j)^2 + rho mean_j (c_ij - 1/S)^2, so
    dL_i/dc_ij = -2/(mC) <p_i - t_i, p_j> + rho 2/S (c_ij - 1/S)."""
    s = len(coefficients)
    p = np.asarray(predictions, np.float64).reshape(s, -1)  # p_j as vectors of m*C
    residual = p - coefficients @ p  # p_i - t_i
    return (-2.0 / p.shape[1]) * residual @ p.T + penalty * (2.0 / s) * (coefficients - 1.0 / s)


def update_coefficients(coefficients: np.ndarray, predictions: np.ndarray,
                        settings: KTpFLSettings) -> np.ndarray:
    """The round's senders' block of the coefficients [S, S] after the code's step: each row
    re-normalised to sum to 1 (a no-op when every client sent: the code's rows always do),
    one gradient step per row (``ktpfl.coefficient-lr``, or 0: :func:`code_step_size` of the
    row's mean |gradient|), then softmax(``ktpfl.softmax-scale`` * row). Float64 [S, S]; each
    row sums to 1. The rows are independent (L_i depends on row i alone), so the code's
    row-by-row loop and this one matrix step are the same."""
    c = np.asarray(coefficients, np.float64)
    c = c / c.sum(axis=1, keepdims=True)
    gradient = coefficient_gradient(c, predictions, settings.penalty)
    if settings.coefficient_lr > 0:
        steps = np.full(len(c), settings.coefficient_lr)
    else:
        steps = np.array([code_step_size(np.abs(row).sum() / len(c)) for row in gradient])
    stepped = settings.softmax_scale * (c - steps[:, None] * gradient)
    stepped -= stepped.max(axis=1, keepdims=True)  # the same softmax, without overflow
    weights = np.exp(stepped)
    return weights / weights.sum(axis=1, keepdims=True)


def personalised_target(row: np.ndarray, predictions: np.ndarray) -> np.ndarray:
    """sum_j c_ij p_j over the senders j, ``row`` re-normalised to sum to 1 (a row the last
    step wrote sums to 1 already): float32 [m, C], a probability vector per sample."""
    weights = np.asarray(row, np.float64) / np.sum(row)
    return np.tensordot(weights, np.asarray(predictions, np.float64), axes=1).astype(np.float32)


# -- the client ----------------------------------------------------------------------------------

def kd_loss(logits: torch.Tensor, target: torch.Tensor, settings: KTpFLSettings) -> torch.Tensor:
    """KL(target || softmax(o / T)), at the scale ``ktpfl.kd-reduction`` names: the code's
    element mean is DS-FL's batch mean (:func:`strategies.dsfl.maths.distillation_loss`)
    divided by C."""
    t = settings.temperature
    loss = distillation_loss(logits / t, target)
    if settings.kd_reduction == "mean":
        return loss / logits.shape[1]
    return loss * t * t if settings.kd_reduction == "batchmean-t2" else loss


def private_epochs(server_round: int, local_epochs: int, settings: KTpFLSettings) -> int:
    """Private epochs of ``server_round``: round 1 is the code's model initialisation
    (``ktpfl.init-epochs``); Flower round t >= 2 is the code's round r = t - 1, which trains
    min(r, local-epochs) epochs with ``ktpfl.epoch-ramp``, local-epochs without."""
    if server_round <= 1:
        return settings.init_epochs
    return min(server_round - 1, local_epochs) if settings.epoch_ramp else local_epochs


class KTpFLClient(FedClient):
    """Distil the personalised target, train on private data, predict on A_t."""

    @property
    def settings(self) -> KTpFLSettings:
        return self.cfg.settings

    def receive(self, payload: Payload, server_round: int) -> None:
        self.target_at = self.target = None
        if payload:
            self.target_at = torch.from_numpy(payload["indices"].astype(np.int64))
            self.target = torch.from_numpy(payload["target"]).float().to(self.device)

    def train(self, server_round: int) -> TrainStats:
        s, x_pub = self.settings, setup.public_on(self.cfg, str(self.device))[0]
        self.distilled = None
        if self.target is not None:
            self.distilled = train_epochs(
                self.model, x_pub[self.target_at.to(self.device)], self.target,
                loss_fn=lambda xb, tb: kd_loss(self.model(xb), tb, s),
                optimizer=self.optimizer(name="distil", lr=s.kd_lr), epochs=s.kd_epochs,
                batch_size=s.kd_batch_size, grad_clip=self.cfg.grad_clip,
                generator=self.batch_generator(server_round, "ktpfl-distil"))
        # local-steps, if a run sets it, replaces the epochs and their ramp.
        epochs = (None if self.cfg.local_steps
                  else private_epochs(server_round, self.cfg.local_epochs, s))
        stats = train_recipe(self.model, self.data.train_x, self.data.train_y,
                             loss_fn=lambda xb, yb: F.cross_entropy(self.model(xb), yb),
                             optimizer=self.optimizer(), cfg=self.cfg,
                             generator=self.batch_generator(server_round), epochs=epochs)
        now = alignment_set(self.cfg.seed, server_round, len(x_pub), s)
        self.soft = probabilities(self.model,
                                  x_pub[torch.from_numpy(now.astype(np.int64)).to(self.device)],
                                  s.temperature)
        return stats

    def upload(self) -> Payload:
        return {"probabilities": self.soft}

    def fit_metrics(self) -> dict:
        return {} if self.distilled is None else {"term-distil": self.distilled.loss}


# -- the server ----------------------------------------------------------------------------------

class KTpFL(FedStrategy):
    """Learns the knowledge-coefficient matrix from the round's soft predictions and sends
    each client its own mix of them."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings: KTpFLSettings = self.cfg.settings
        self.public_size = len(setup.public_set(self.cfg, labels=False))
        n = self.cfg.num_clients
        self.coefficients = np.full((n, n), 1.0 / n)  # c, float64 [N, N]: the code's 1/N
        # One round's uploads, all the server keeps of them: the senders' partition ids [S],
        # their soft predictions [S, m, C] and A_t's indices [m] (None before round 1 ends).
        self.senders = np.zeros(0, np.int64)
        self.predictions: np.ndarray | None = None
        self.indices: np.ndarray | None = None

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        if self.predictions is None or client is None:
            return {}
        row = self.coefficients[client.partition_id, self.senders]
        return {"indices": self.indices, "target": personalised_target(row, self.predictions)}

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return {"probabilities": ArraySpec((self.settings.alignment_size, self.num_classes))}

    def check_upload(self, payload: Payload, client: ClientInfo) -> None:
        # Probability vectors only, so that every target stays one.
        check_probabilities(payload["probabilities"])

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        # Under robust-aggregation the rule drops outlying prediction tables: a dropped
        # client is then no sender of this round (its coefficients and predictions unused).
        _, keep = self.teachers([u.payload for u in uploads],
                                [u.client.partition_id for u in uploads], what="the predictions")
        uploads = [u for u, kept in zip(uploads, keep) if kept]
        senders = np.array([u.client.partition_id for u in uploads], np.int64)
        predictions = np.stack([u.payload["probabilities"] for u in uploads]).astype(np.float32)
        block = np.ix_(senders, senders)
        self.coefficients[block] = update_coefficients(self.coefficients[block], predictions,
                                                       self.settings)
        self.senders, self.predictions = senders, predictions
        self.indices = alignment_set(self.cfg.seed, server_round, self.public_size,
                                     self.settings)
