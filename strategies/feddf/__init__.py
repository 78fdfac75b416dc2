"""FedDF's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``; the page: docs/feddf.md)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import ConfigError, RunConfig, opt
from strategies import Method, public_labels

STUDENT_LOSSES = ("avg-logits", "avg-probs", "avg-losses")


@dataclass(frozen=True)
class FedDFSettings:
    """``feddf.*``: the per-architecture average and the server's ensemble distillation."""

    average: str = opt(
        "uniform", "how the uploads of one architecture are averaged into the student's start "
        "x_a: 'uniform' (the authors' code, one weight per client) or 'samples' (n_k, FedAvg's)",
        choices=("uniform", "samples"))
    student_loss: str = opt(
        "avg-logits", "distillation loss: 'avg-logits' KL(softmax(mean teacher logits / T) || "
        "softmax(student / T)) (paper, README), 'avg-probs' the mean of the teachers' "
        "probabilities as the target, 'avg-losses' the mean of one KL per teacher (the code's "
        "default update_student_scheme)", choices=STUDENT_LOSSES)
    temperature: float = opt(1.0, "distillation temperature T (code: 1); no T^2 factor, as "
                             "the code", low=0.0, low_open=True)
    server_steps: int = opt(
        200, "distillation steps per architecture per round, one public batch each (paper and "
        "code: 10,000; 200 keeps a CPU round short); 0 = per-architecture averaging only",
        low=0)
    server_lr: float = opt(1e-3, "the student's Adam learning rate, cosine-annealed to 0 over "
                           "server-steps (code: 1e-3)", low=0.0, low_open=True)
    server_batch_size: int = opt(0, "public samples per distillation step (0 = the run's "
                                 "batch-size, as the code's loader)", low=0)
    server_grad_clip: float = opt(5.0, "the student's gradient-norm clip (code: 5; 0 = none)",
                                  low=0.0)
    early_stopping: bool = opt(
        False, "validate the student on a labelled held-out share of the public set every "
        "validation-every steps, stop after early-stopping-patience steps without a better "
        "accuracy and keep the best student (the code's, on a labelled split of the training "
        "data); needs public-labels = 'labelled'. Off: every step runs and the last student "
        "is kept")
    validation_every: int = opt(100, "steps between two validations (code: 100)", low=1)
    early_stopping_patience: int = opt(
        1000, "steps without a better validation accuracy before the distillation stops "
        "(the README's commands' early_stopping_server_batches: 1000; the code's "
        "aggregate() falls back to 2000 when none is given)", low=1)
    validation_fraction: float = opt(
        0.1, "share of the public set held out, with its labels, for early stopping (the "
        "code's val_data_ratio: 0.1 of the training data); used only with early-stopping",
        low=0.0, high=0.5, low_open=True)

    def reads_public_labels(self, cfg: RunConfig) -> bool:
        return self.early_stopping

    def check(self, cfg: RunConfig) -> None:
        if not self.early_stopping:
            return
        if not public_labels(cfg):
            raise ConfigError(
                "setting feddf.early-stopping = true validates the student on labelled public "
                "samples, but the method may not read the public labels: set public-labels = "
                "'labelled' (or feddf.early-stopping = false, the paper's unlabelled "
                "distillation).")
        if cfg.public_source == "digits":
            raise ConfigError(
                "setting feddf.early-stopping = true is invalid with public-source = 'digits': "
                "its labels (the digits 0-9) are not the private data's classes, so they cannot "
                "validate a student; use public-source = 'train-holdout'.")


# The README's command (epfml/federated-learning-public-code, FedDF-code): plain SGD 0.1 without
# momentum, weight decay or clipping, batch 64, a new optimizer every round, local_n_epochs 40;
# 40 epochs a round do not fit a CPU default, so 5 (a preset or --set restores 40).
RECIPE = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "weight-decay": 0.0,
          "grad-clip": 0.0, "optimizer-state": "fresh", "batch-size": 64, "local-epochs": 5,
          "local-steps": 0}

METHOD = Method("FedAvg within each architecture, then the server distils the ensemble of every "
                "uploaded model into each architecture's average on an unlabelled public set",
                strategy_class="FedDF", client_class="FedDFClient", settings=FedDFSettings,
                recipe=RECIPE, needs_public=True, public_labels=False,
                # Every upload teaches every student, so a robust rule filters the uploads
                # (within each architecture), and both the averages x_a and the teachers are
                # the kept uploads (FedStrategy.teachers).
                payload_kinds=("group-teachers",),
                secure_aggregation=(
                    "its server distils the ensemble of the individual client models into each "
                    "architecture's average"))
