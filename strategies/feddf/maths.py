"""FedDF (Lin, Kong, Stich and Jaggi, "Ensemble Distillation for Robust Model Fusion in Federated
Learning", NeurIPS 2020): FedAvg within each architecture, then ensemble distillation of every
received model into each architecture's average, on unlabelled data the server holds.

Client: plain local training from its architecture's server model (cross-entropy, the card's
recipe); it uploads its whole model. It is the FedAvg client, with a payload per architecture.

Server, each round (the authors' ``noise_knowledge_transfer.NoiseKTSolver.distillation``):

1. for each architecture a with a client this round, x_a = the **uniform** mean of its uploaded
   models (``feddf.average``; the code does not weight by samples);
2. the student starts at x_a, in train mode (its BatchNorm statistics follow the public
   batches, as the code's); the teachers are **every** received model of any architecture, in
   eval mode and frozen. With ``robust-aggregation`` set, the rule first filters each
   architecture's uploads (:meth:`~fedapp.runtime.strategy_base.FedStrategy.teachers`), and
   both x_a and the teachers are the kept models;
3. ``feddf.server-steps`` steps, each on one batch of the public set (a fresh seeded shuffle per
   pass), of ``feddf.student-loss`` (default ``avg-logits``: KL(σ(ō/T) ‖ σ(s/T)), batch mean,
   no T² factor, ō the mean of the teachers' logits) with Adam (``feddf.server-lr``, cosine
   annealed to 0 over the steps) and the gradient norm clipped at 5;
4. without ``feddf.early-stopping`` the last student is the architecture's new server model;
   with it, the student is validated every ``feddf.validation-every`` steps on a labelled
   held-out share of the public set, training stops after ``feddf.early-stopping-patience``
   steps without a better accuracy, and the best student is kept;
5. architectures with no client this round keep their model.

Every random draw (the public batches, dropout in the student) comes from generators keyed by
``(seed, purpose, round, architecture)``; the teachers live only inside one round's
aggregation, so the server holds at most one round's uploads.

Evaluation: clients evaluate their architecture's server model on their own test split (FedAvg's
evaluation), and :meth:`FedDF.server_predict` gives each distilled server model's logits on a
batch of global test inputs (the paper's measure).

Traffic per client per round: the whole model of its architecture down, the same up.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from fedapp.config import ConfigError
from fedapp.data import setup
from fedapp.runtime.aggregate import average_per_group
from fedapp.runtime.client_base import load_arrays, state_arrays
from fedapp.runtime.payload import ArraySpec, Payload
from fedapp.runtime.strategy_base import ClientInfo, FedStrategy, Upload
from fedapp.runtime.training import EVAL_BATCH
from fedapp.seeding import derive_seed, isolated_rng
from strategies.feddf import FedDFSettings
from strategies.fedavg.maths import FedAvgClient
from strategies.fedper.maths import arrays_spec


def ensemble_target(teacher_logits: torch.Tensor, kind: str, temperature: float
                    ) -> torch.Tensor:
    """The distribution the student is pulled towards, from the teachers' logits [K, B, C]:
    σ(mean_k o_k / T) ('avg-logits') or mean_k σ(o_k / T) ('avg-probs'), [B, C]."""
    if kind == "avg-logits":
        return F.softmax(teacher_logits.mean(0) / temperature, dim=-1)
    if kind == "avg-probs":
        return F.softmax(teacher_logits / temperature, dim=-1).mean(0)
    raise ValueError(f"{kind!r} has no single target: each teacher is its own")


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str,
                      temperature: float) -> torch.Tensor:
    """The student's loss on one batch: KL(target ‖ σ(s/T)), batch mean, no T² factor (the
    code's ``divergence``), against the ensemble's target, or for 'avg-losses' the mean over
    the K teachers of KL(σ(o_k/T) ‖ σ(s/T)). ``teacher_logits`` is [K, B, C]."""
    log_student = F.log_softmax(student_logits / temperature, dim=-1)
    if kind == "avg-losses":
        return torch.stack([F.kl_div(log_student, F.log_softmax(o / temperature, dim=-1),
                                     reduction="batchmean", log_target=True)
                            for o in teacher_logits]).mean()
    if kind == "avg-logits":  # in log space: exact where a probability underflows to 0
        return F.kl_div(log_student, F.log_softmax(teacher_logits.mean(0) / temperature, -1),
                        reduction="batchmean", log_target=True)
    return F.kl_div(log_student, ensemble_target(teacher_logits, kind, temperature),
                    reduction="batchmean")


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy of ``model`` in eval mode; the model is left in eval mode."""
    model.eval()
    correct = sum(int((model(x[i:i + EVAL_BATCH]).argmax(1) == y[i:i + EVAL_BATCH]).sum())
                  for i in range(0, len(x), EVAL_BATCH))
    return correct / max(len(y), 1)


def distil(student: torch.nn.Module, teachers: list[torch.nn.Module], public_x: torch.Tensor,
           settings: FedDFSettings, batch_size: int, seed: int,
           validation: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
    """``settings.server_steps`` steps of ensemble distillation of ``teachers`` into
    ``student`` (changed in place) on batches of ``public_x``, shuffled afresh for every pass
    from ``seed``. With ``validation`` (early stopping) the best validated student is loaded at
    the end. A step whose loss or gradient is not finite (a teacher whose BatchNorm statistics
    an attacker broke) is skipped, so that the student stays finite. Returns the mean loss,
    the steps run and those skipped."""
    s = settings
    for teacher in teachers:
        teacher.eval()
        teacher.requires_grad_(False)
    optimizer = torch.optim.Adam(student.parameters(), lr=s.server_lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(s.server_steps, 1))
    order = torch.Generator().manual_seed(seed)
    n, batch_size = len(public_x), max(1, min(batch_size, len(public_x)))
    batches: list[torch.Tensor] = []
    losses: list[float] = []
    skipped = steps = 0
    best: tuple[float, int, dict[str, torch.Tensor]] | None = None
    student.train()
    for steps in range(1, s.server_steps + 1):
        if not batches:  # a new pass over the public set, as the code's loader restarts
            batches = list(torch.randperm(n, generator=order).split(batch_size))[::-1]
        x = public_x[batches.pop()]
        with torch.no_grad():
            teacher_logits = torch.stack([teacher(x) for teacher in teachers])
        loss = distillation_loss(student(x), teacher_logits, s.student_loss, s.temperature)
        optimizer.zero_grad(set_to_none=True)
        if torch.isfinite(loss):
            loss.backward()
            norm = (torch.nn.utils.clip_grad_norm_(student.parameters(), s.server_grad_clip)
                    if s.server_grad_clip > 0 else torch.zeros(()))
            if torch.isfinite(norm):
                optimizer.step()
                losses.append(float(loss.detach()))
            else:
                skipped += 1
        else:
            skipped += 1
        schedule.step()
        if validation is not None and steps % s.validation_every == 0:
            score = accuracy(student, *validation)
            student.train()
            if best is None or score > best[0]:
                best = (score, steps, {k: v.detach().clone()
                                       for k, v in student.state_dict().items()})
            elif steps - best[1] >= s.early_stopping_patience:
                break
    if best is not None:  # none when no validation fell within the steps: the last is kept
        student.load_state_dict(best[2])
    return {"loss": float(np.mean(losses)) if losses else math.nan, "steps": steps,
            "skipped": skipped}


class FedDFClient(FedAvgClient):
    """FedAvg's client: installs its architecture's server model, trains it with
    cross-entropy, uploads all of it."""


class FedDF(FedStrategy):
    """One server model per architecture: averaged per architecture, then distilled from the
    ensemble of every upload of the round."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings: FedDFSettings = self.cfg.settings
        if self.settings.early_stopping and setup.public_set(self.cfg).y is None:
            raise ConfigError("setting feddf.early-stopping = true validates the student on "
                              "labelled public samples, but the public set has no labels "
                              "(a public-file without y); set feddf.early-stopping = false")
        self.models: dict[str, Payload] = {
            arch: state_arrays(self.new_model(arch)) for arch in sorted(set(self.architectures))}
        # What the last aggregation's distillation did, per architecture (steps, loss).
        self.distillation: dict[str, dict[str, float]] = {}
        # server_predict's modules of self.models, rebuilt when a model changes.
        self._predictors: dict[str, tuple[Payload, torch.nn.Module]] = {}

    def method_state(self) -> dict:
        # The predictors are a cache of self.models, not state: a resumed run rebuilds them.
        return {k: v for k, v in super().method_state().items() if k != "_predictors"}

    def fit_payload(self, server_round: int, client: ClientInfo | None) -> Payload:
        # One dict per architecture: encoded once per round for all its clients.
        return self.models[client.arch] if client is not None else {}

    eval_payload = fit_payload  # clients evaluate the server model of their architecture

    def upload_spec(self, client: ClientInfo) -> dict[str, ArraySpec]:
        return arrays_spec(self.models[client.arch])

    def module(self, arch: str, arrays: Payload) -> torch.nn.Module:
        """A model of ``arch`` holding ``arrays``."""
        model = self.new_model(arch)
        load_arrays(model, arrays)
        return model

    def public_split(self) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The public inputs the students are distilled on and, with early stopping, the
        labelled held-out share they are validated on (drawn once per run from the seed)."""
        s = self.settings
        public = setup.public_set(self.cfg, labels=s.early_stopping)
        if not s.early_stopping:
            return public.x, None
        order = torch.randperm(len(public), generator=torch.Generator().manual_seed(
            derive_seed(self.cfg.seed, "feddf-validation")))
        held = min(max(1, round(s.validation_fraction * len(public))), len(public) - 1)
        val, rest = order[:held], order[held:]
        return public.x[rest], (public.x[val], public.y[val])

    def aggregate(self, server_round: int, uploads: list[Upload]) -> None:
        s = self.settings
        # Under robust-aggregation the rule drops (or, norm-bound, moves) outlying models
        # within each architecture: both the averages x_a and the teachers are the kept ones.
        archs = [u.client.arch for u in uploads]
        payloads, keep = self.teachers([u.payload for u in uploads],
                                       [u.client.partition_id for u in uploads], archs)
        kept = [i for i in range(len(uploads)) if keep[i]]
        archs, payloads = [archs[i] for i in kept], [payloads[i] for i in kept]
        weights = [1.0 if s.average == "uniform" else float(uploads[i].num_examples)
                   for i in kept]
        averages = average_per_group(archs, payloads, weights)
        self.distillation = {}
        if s.server_steps > 0:
            public_x, validation = self.public_split()
            teachers = [self.module(arch, p) for arch, p in zip(archs, payloads)]
            for arch in sorted(averages):
                seed = derive_seed(self.cfg.seed, "feddf-distillation", server_round, arch)
                student = self.module(arch, averages[arch])
                # Dropout in the student draws from torch's global stream: keyed here.
                with isolated_rng(seed):
                    self.distillation[arch] = distil(
                        student, teachers, public_x, s,
                        s.server_batch_size or self.cfg.batch_size,
                        derive_seed(self.cfg.seed, "feddf-batches", server_round, arch),
                        validation)
                averages[arch] = state_arrays(student)
        # Architectures with no client this round keep their model.
        self.models.update(averages)

    @torch.no_grad()
    def server_predict(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The logits of the models the server holds, by name, on a batch of global test
        inputs: each architecture's distilled server model, in eval mode."""
        out = {}
        for arch, arrays in self.models.items():
            cached = self._predictors.get(arch)
            if cached is None or cached[0] is not arrays:
                cached = self._predictors[arch] = (arrays, self.module(arch, arrays))
            model = cached[1].eval()
            out[arch] = model(x.to(next(model.parameters()).device))
        return out
