"""FedClassAvg (Jang et al., ICPP 2022): classifier averaging with supervised contrastive
representation learning.

Every client model is its own extractor F_k (any architecture, projected to a shared d = 512)
plus a one-layer classifier C_k: Linear(d, C), the only shared part. Each round a client loads
the global classifier w_C, trains E local epochs on

    L = L_supcon([F_k(x'), F_k(x'')], y) + CE(C_k(F_k(x')), y) + rho * L_R(w_Ck, w_C)

with two random augmented views x', x'' of every image, and uploads its classifier; the server
averages the classifiers weighted by the clients' sample counts n_k (as LG-FedAvg does with its
head: the server side is the same). Per client per round d*C + C floats go each way (5130 for
d = 512, C = 10).

Where the classifier's ReLU sits: the reference code's extractor ends in the projection
``fcin: Linear(backbone, 512)`` without activation and its classifier is ``ReLU -> Linear``.
Models here end their extractor in ``Linear -> ReLU`` (``client_models.base.finish_model``) and
the head is the Linear; the logits are the same, and the contrastive loss reads the features
before that final ReLU (``supcon-features = "pre-relu"``, the code's choice), or after it.

Every point the paper leaves open is a setting; the defaults follow the paper, except the
contrastive loss's form and views, which the paper leaves open: the defaults are the usual
normalised SupCon (T = T_base = 0.07) on the raw images, measured to hold beside local training
on two data sets, where the reference code's form (T = 100 on unnormalised features, SimCLR
crops) loses to it (docs/fedclassavg.md); conf/fedclassavg-code.toml pins the code's values.
The ablation of the paper's Table 4 runs by configuration: ``contrastive = false`` and/or
``proximal = false``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedapp.data.augment import ViewAugment
from fedapp.runtime.client_base import VERSION_KEY
from fedapp.runtime.payload import Payload
from fedapp.runtime.training import train_recipe
from fedapp.seeding import derive_seed
from strategies.fedclassavg import PROXIMAL_FORMS
from strategies.lg_fedavg.maths import LgFedAvg, LgFedAvgClient

# The views of ``fedclassavg.views`` (None: the raw images).
VIEWS = {"simclr": ViewAugment(),
         "mild": ViewAugment(crop_scale=(0.8, 1.0), crop_ratio=(0.9, 1.1), flip_p=0.0,
                             jitter_p=0.0, grayscale_p=0.0),
         "none": None}


# -- losses -------------------------------------------------------------------------------------

def supcon_loss(views: Tensor, labels: Tensor, temperature: float, base_temperature: float,
                normalize: bool) -> Tensor:
    """Supervised contrastive loss (Khosla et al., 2020) over ``views [B, V, d]``.

    Every one of the V*B view features is an anchor; its positives are all other views with
    its label (its own other views included), its denominator all other views:
    ``-(T/T_base) * mean_i 1/|P(i)| sum_{p in P(i)} log(exp(z_i.z_p/T) / sum_{a != i}
    exp(z_i.z_a/T))`` — the reference ``losses.SupConLoss`` with contrast_mode 'all'."""
    b, v, _ = views.shape
    z = torch.cat(views.unbind(1), dim=0)  # [V*B, d], view-major as the reference code
    if normalize:
        z = F.normalize(z, dim=1)
    logits = z @ z.T / temperature
    # Subtracting the row max changes nothing mathematically and keeps exp() finite.
    logits = logits - logits.max(dim=1, keepdim=True).values.detach()
    y = labels.repeat(v)
    not_self = ~torch.eye(v * b, dtype=torch.bool, device=z.device)
    positive = (y[:, None] == y[None, :]) & not_self
    log_denominator = torch.logsumexp(logits.masked_fill(~not_self, float("-inf")), dim=1)
    log_prob = logits - log_denominator[:, None]
    # With V >= 2 every anchor has at least one positive (its own other view).
    mean_log_prob_pos = (log_prob * positive).sum(1) / positive.sum(1)
    return -(temperature / base_temperature) * mean_log_prob_pos.mean()


def proximal_term(params: list[Tensor], anchors: list[Tensor], form: str) -> Tensor:
    """Distance of the classifier ``params`` to the global classifier ``anchors`` (see
    ``FedClassAvgSettings.proximal_form``)."""
    diffs = [p - a for p, a in zip(params, anchors)]
    if form == "l2":
        # One norm over all the classifier's entries; vector_norm's gradient at 0 is 0 (a
        # subgradient), where sqrt(sum of squares) would give NaN on the first step (w = w_C).
        return torch.linalg.vector_norm(torch.cat([d.flatten() for d in diffs]))
    if form == "squared":
        return 0.5 * sum(d.pow(2).sum() for d in diffs)
    if form == "code-mse":
        return 0.5 * sum(d.pow(2).mean() for d in diffs)
    raise ValueError(f"unknown proximal form {form!r}; expected one of {PROXIMAL_FORMS}")


def _pre_relu_extractor(extractor: nn.Module) -> nn.Module:
    """The extractor without its final ReLU (the reference code's ``fcin`` output); an
    extractor that does not end in one is its own pre-ReLU version."""
    if isinstance(extractor, nn.Sequential) and isinstance(extractor[-1], nn.ReLU):
        return extractor[:-1]
    return extractor


# -- client and server ------------------------------------------------------------------------

class FedClassAvgClient(LgFedAvgClient):
    """Loads the global classifier, trains SupCon + CE + rho * proximal, uploads the
    classifier (upload and evaluation as LG-FedAvg: the personalised model is evaluated)."""

    def receive(self, payload: Payload, server_round: int) -> None:
        # The views of this round, keyed by (seed, partition, round) like every random stream.
        self.view_generator = torch.Generator(device=self.device).manual_seed(
            derive_seed(self.cfg.seed, "views", self.partition_id, server_round))
        if self.cfg.settings.warmup and server_round >= 1 and not self._has_trained():
            self._warm_up(server_round)
        super().receive(payload, server_round)
        # The global classifier w_C, fixed for the round, for the proximal term.
        self.global_classifier = [p.detach().clone() for p in self.model.head.parameters()]
        self._batch = 0
        self.reset_terms()  # the warm-up's batches are not the round's

    def _has_trained(self) -> bool:
        return VERSION_KEY in self.context.state  # saved after every fit

    def _warm_up(self, server_round: int) -> None:
        """The reference code's local pre-training before round 1: SupCon + CE, no proximal
        term (there is no global classifier yet)."""
        self.global_classifier, self._batch = None, 0
        train_recipe(self.model, self.data.train_x, self.data.train_y, loss_fn=self.loss,
                     optimizer=self.optimizer(), cfg=self.cfg, epochs=self.cfg.local_epochs,
                     generator=torch.Generator().manual_seed(
                         derive_seed(self.cfg.seed, "warmup", self.partition_id)))

    def _supcon_extractor(self) -> nn.Module:
        extractor = self.model.extractor
        return (_pre_relu_extractor(extractor) if self.cfg.settings.supcon_features == "pre-relu"
                else extractor)

    def _view(self, x: Tensor) -> Tensor:
        augment = VIEWS[self.cfg.settings.views]
        return x if augment is None else augment(x, self.view_generator)

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        s = self.cfg.settings
        model, extractor = self.model, self._supcon_extractor()
        terms: dict[str, Tensor] = {}
        batch = [self._view(x), self._view(x)] if s.contrastive else [self._view(x)]
        raw_ce = s.ce_view == "raw" and s.views != "none"
        # Every view in one forward pass (BatchNorm sees them together, as in the code).
        z = extractor(torch.cat(batch + [x] if raw_ce else batch)).chunk(len(batch) + raw_ce)
        if s.contrastive:
            terms["supcon"] = supcon_loss(torch.stack(z[:2], dim=1), y, s.temperature,
                                          s.base_temperature, s.normalize_features)
        # The classifier's ReLU: a no-op on post-ReLU features, the code's ReLU on pre-ReLU.
        terms["ce"] = F.cross_entropy(model.head(F.relu(z[-1] if raw_ce else z[0])), y)
        first_batch = self._batch % self._batches_per_epoch() == 0
        self._batch += 1
        if (s.proximal and self.global_classifier is not None
                and not (s.proximal_skip_first_batch and first_batch)):
            terms["proximal"] = s.rho * proximal_term(list(model.head.parameters()),
                                                      self.global_classifier, s.proximal_form)
        self._record_terms(terms)
        return sum(terms.values())

    def _record_terms(self, terms: dict[str, Tensor]) -> None:
        """Add each term's value (as it enters the loss, weights and T/T_base included) to the
        round's sums, and with ``diagnose`` its gradient norm on the extractor and on the
        classifier: with Adam a term whose gradient is orders of magnitude larger than the
        others sets the direction of every step alone."""
        record = {f"{name}-loss": term.detach() for name, term in terms.items()}
        if self.cfg.settings.diagnose:
            parts = {"extractor": list(self.model.extractor.parameters()),
                     "classifier": list(self.model.head.parameters())}
            for name, term in terms.items():
                for part, params in parts.items():
                    grads = [g for g in torch.autograd.grad(term, params, retain_graph=True,
                                                            allow_unused=True) if g is not None]
                    if grads:
                        record[f"{name}-grad-{part}"] = torch.linalg.vector_norm(
                            torch.cat([g.flatten() for g in grads]))
        self.record_terms(record)

    @torch.no_grad()
    def evaluation_variants(self, x: Tensor, y: Tensor) -> dict[str, float]:
        """With ``diagnose``: ``ncm``, how well the extractor alone separates the classes
        (nearest class mean of the L2-normalised features SupCon sees, the means taken on the
        client's training data), whatever the classifier has learnt."""
        if not self.cfg.settings.diagnose or not len(self.data.train_y):
            return {}
        self.model.eval()
        extractor, n_classes = self._supcon_extractor(), self.num_classes

        def features(images: Tensor) -> Tensor:
            return F.normalize(torch.cat([extractor(images[i:i + 512])
                                          for i in range(0, len(images), 512)]), dim=1)

        train = features(self.data.train_x)
        sums = torch.zeros(n_classes, train.shape[1], device=train.device).index_add_(
            0, self.data.train_y, train)
        present = torch.bincount(self.data.train_y, minlength=n_classes) > 0
        means = F.normalize(sums, dim=1)
        scores = (features(x) @ means.T).masked_fill(~present, float("-inf"))
        return {"ncm": float((scores.argmax(1) == y).float().mean())}

    def _batches_per_epoch(self) -> int:
        return max(1, math.ceil(len(self.data.train_y) / self.cfg.batch_size))


class FedClassAvg(LgFedAvg):
    """The global classifier (initialised from one model's random classifier) averaged over
    the round's uploads weighted by n_k, normalised over the participants (reference code)."""
