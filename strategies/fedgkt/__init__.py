"""FedGKT's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import ConfigError, RunConfig, UploadLayout, opt
from strategies import Method


@dataclass(frozen=True)
class FedGKTSettings:
    """``fedgkt.*``: the server model, the two distillation terms and the server's training.

    The client's epochs are ``local-epochs`` (the paper's ``epochs_client``, set by the
    recipe); where the client model is cut is its family's stem (``client_models.stems``)."""

    server_arch: str = opt("gkt-server-resnet20", "the server model, any architecture of the "
                           "zoo built on the clients' stem map (gkt-server-resnet56: the "
                           "reference's ResNet-56 server; -resnet20: its CPU-sized stand-in)")
    alpha: float = opt(1.0, "alpha, weight of the client's distillation term KL_T(z_s || o)",
                       low=0.0)
    temperature: float = opt(3.0, "T, the distillation temperature (both directions)",
                             low=0.0, low_open=True)
    server_epochs: int = opt(3, "passes of the server model over the round's uploads "
                             "(epochs_server: 3 in main_fedgkt.py; 20 in the README's command, "
                             "a CPU's 7 times the work)", low=1)
    server_distill: bool = opt(False, "add KL_T(o_client || g(H)) to the server's CE "
                               "(whether_distill_on_the_server; the code's default is off)")
    server_weighting: str = opt(
        "paper", "with server-distill: 'paper' = CE + alpha * KL, as on the client (the "
        "spec's reading of the paper; docs/fedgkt.md); 'code' = KL + alpha * CE, the "
        "reference's server loss", choices=("paper", "code"))
    server_order: str = opt(
        "clients", "order of the server's mini-batches: 'clients' (client after client in "
        "partition order, each one's samples in id order: the reference with the unshuffled "
        "loaders it means) or 'shuffled' (all "
        "the round's samples pooled and reshuffled every epoch, from a keyed generator)",
        choices=("clients", "shuffled"))
    server_logits: str = opt(
        "last-epoch", "the logits sent back: 'last-epoch' (recorded in train mode during the "
        "server's last epoch: the reference) or 'eval' (one pass in eval mode after it)",
        choices=("last-epoch", "eval"))
    eval_server_model: bool = opt(
        True, "send the server model for evaluation, so that each client also reports its "
        "stem + the server model (accuracy-server-model: the paper's metric), counted in "
        "eval_bytes_down")

    def check(self, cfg: RunConfig) -> None:
        # The models import torch.
        from client_models import ModelConfigError, parse_arch_mix
        from fedapp.data.local_data import DATASET_INPUTS, expected_input
        from fedapp.data.setup import architectures
        try:
            if len(parse_arch_mix(self.server_arch)) != 1:
                raise ModelConfigError("name one architecture")
        except ModelConfigError as exc:
            raise ConfigError(f"setting fedgkt.server-arch = {self.server_arch!r} is invalid: "
                              f"{exc}") from None
        # The input is known without reading the data for the built-in data sets: refuse a mix
        # of stems one server model cannot take before anything starts (a user's own files
        # are checked when the server builds its model).
        if cfg.dataset == "synthetic" or cfg.dataset in DATASET_INPUTS:
            try:
                self.server_input(cfg, architectures(cfg), *expected_input(cfg))
            except ModelConfigError as exc:
                raise ConfigError(f"method 'fedgkt' with arch-mix = {cfg.arch_mix!r} and "
                                  f"fedgkt.server-arch = {self.server_arch!r}: {exc}") from None

    def build_own_models(self, cfg: RunConfig, input_shape: tuple[int, int, int],
                         num_classes: int) -> None:
        """The server model on the clients' maps, which the data set-up builds once: a user's
        own data set's input is known only then."""
        from fedapp.data.setup import architectures
        self.server_input(cfg, architectures(cfg), input_shape, num_classes)

    def server_input(self, cfg: RunConfig, archs: list[str], input_shape: tuple[int, int, int],
                     num_classes: int) -> tuple[int, ...]:
        """The map every client's stem emits, checked to be one shape that the server model
        builds on (raises client_models.ModelConfigError)."""
        from client_models import build_model
        from client_models.stems import common_stem_shape
        shape = common_stem_shape(archs, input_shape, num_classes, cfg.feature_dim or None,
                                  cfg.model_width)
        build_model(self.server_arch, shape, num_classes, width=cfg.model_width)
        return shape


# The README's command, with which the authors ran their reported results: Adam lr 1e-3,
# 1 client epoch, batch 256 (the trainers' Adam has weight decay 1e-4); optimizers built once
# and kept; no clipping; each model keeps its own representation size (no shared d is
# exchanged). main_fedgkt.py's defaults (SGD lr 0.1, momentum 0.9, weight decay 5e-4, batch 64,
# 3 epochs) diverge on the zoo's CNNs without BatchNorm (docs/fedgkt.md, "Recipe"): a preset
# away. docs/recipes.md.
RECIPE = {"optimizer": "adam", "lr": 0.001, "weight-decay": 1e-4, "grad-clip": 0.0,
          "batch-size": 256, "local-epochs": 1, "local-steps": 0, "optimizer-state": "keep",
          "feature-dim": 0}

METHOD = Method("group knowledge transfer: each client uploads its stem's feature map, logits "
                "and label for every training sample; a large server model trains on them "
                "and sends back its logits, the clients' KD targets (same stem map shape)",
                strategy_class="FedGKT", client_class="FedGKTClient",
                settings=FedGKTSettings, recipe=RECIPE,
                payload_kinds=("server-distillation",),
                secure_aggregation=("its server trains its large model on each client's individual "
                                    "feature maps and logits"),
                upload_layout=UploadLayout(labels="labels", rows=("features", "logits"),
                                           logits=("logits",)))
