"""CompFL's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import opt
from fedapp.runtime.recipes import SGD_HALF
from strategies import Method


@dataclass(frozen=True)
class CompFLSettings:
    """``compfl.*``: the three components, their weights and the open points of the paper."""

    align: bool = opt(True, "feature alignment L_align (Table 3 'Align')")
    greedy: bool = opt(True, "epsilon-greedy model selection (Table 3 'Greedy')")
    kd: bool = opt(True, "ensemble knowledge distillation L_kd (Table 3 'KD')")
    lam: float = opt(1.0, "weight lambda of L_align (paper: 1)", low=0.0, key="lambda")
    mu: float = opt(1.0, "weight mu of L_kd (paper: 1)", low=0.0)
    epsilon: float = opt(0.3, "probability of training a uniformly drawn smaller-or-equal "
                         "expert (paper: 0.3)", low=0.0, high=1.0)
    tau: float = opt(0.1, "temperature of the expert weights softmax(minmax(acc) / tau) "
                     "(paper: 0.1)", low=0.0, low_open=True)
    head_lr: float = opt(0.1, "learning rate eta_g of the head fine-tuning after the prototype "
                         "init (not in the paper; FedPAC: 0.1)", low=0.0, low_open=True)
    head_epochs: int = opt(1, "epochs of head fine-tuning after the prototype init (paper: 1)",
                           low=0)
    prototype_init: str = opt("normalised", "head rows of local classes := 'normalised' or "
                              "'raw' class prototypes", choices=("normalised", "raw"))
    align_form: str = opt("mse", "L_align: 'mse' (FedPAC: mean over samples and dimensions) or "
                          "'squared-norm' (paper: mean over samples of ||z - z~||^2)",
                          choices=("mse", "squared-norm"))
    kd_direction: str = opt("target-first", "L_kd: 'target-first' KL(t || local) (usual KD) or "
                            "'prediction-first' KL(local || t) (the paper's formula as printed)",
                            choices=("target-first", "prediction-first"))
    kd_teachers: str = opt("own-and-smaller", "distillation ensemble: 'own-and-smaller' (the own "
                           "adapted expert and the smaller ones) or 'smaller' (appendix)",
                           choices=("own-and-smaller", "smaller"))
    kd_warmup: float = opt(0.1, "fraction of num-server-rounds before KD starts", low=0.0,
                           high=1.0)
    upload: str = opt("delta", "upload the trained extractor as the 'delta' to the received one "
                      "(Algorithm 1) or as 'weights' (same server result)",
                      choices=("delta", "weights"))


METHOD = Method("experts ordered by size share per-architecture extractors; prototype "
                "head adaptation, epsilon-greedy expert choice, CE + lambda * alignment + "
                "mu * ensemble KD",
                strategy_class="CompFL", client_class="CompFLClient", settings=CompFLSettings,
                decentralised=True,
                # Paper App. B with FedPAC's learning rate (CompFL gives none).
                recipe={**SGD_HALF, "weight-decay": 0.0005, "batch-size": 50,
                        "local-epochs": 5},
                payload_kinds=("group-model",),
                # In server mode: a table of every expert's extractor, the trained one
                # in its slot (docs/privacy.md); walk and gossip sum nothing.
                secure_aggregation="fixed-layout")
