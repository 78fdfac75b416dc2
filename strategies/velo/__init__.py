"""Velo's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import UploadLayout, opt
from strategies import Method
from strategies.felo import RECIPE, FeloSettings


@dataclass(frozen=True)
class VeloSettings(FeloSettings):
    """``velo.*``: Felo's settings plus the server's CVAE."""

    cvae_hidden: int = opt(0, "CVAE hidden layer width h (0 = d, as the code)", low=0)
    cvae_latent: int = opt(0, "CVAE latent size (0 = d, as the code)", low=0)
    cvae_embedding: int = opt(32, "CVAE label embedding size e (code: 512; scaled down for "
                              "the small d of CPU runs)", low=1)
    cvae_decoder_relu: bool = opt(False, "a ReLU between the decoder's two layers (the code "
                                  "has none)")
    cvae_epochs: int = opt(10, "CVAE epochs over the stored features per training (code: 10)",
                           low=1)
    cvae_lr: float = opt(0.001, "CVAE Adam learning rate (code: 1e-3)", low=0.0, low_open=True)
    cvae_batch_size: int = opt(50, "CVAE mini-batch size (code: the client batch, 50)", low=2)
    cvae_kl_weight: float = opt(1.0, "weight of the KL term (code: 1, summed over the batch)",
                                low=0.0)
    retrain_every: int = opt(1, "train the CVAE every n rounds (paper Table 4: 1..10)", low=1)


METHOD = Method("Felo whose server trains a conditional VAE on the features and sends one "
                "decoded feature per class",
                strategy_class="Velo", client_class="VeloClient", shared_dim=True,
                settings=VeloSettings, recipe=RECIPE,
                payload_kinds=("group-model", "class-rows", "server-training"),
                secure_aggregation=(
                    "its server trains a conditional VAE on the individual uploaded features"),
                upload_layout=UploadLayout(labels="class-labels",
                                           rows=("class-features", "class-logits"),
                                           logits=("class-logits",)))
