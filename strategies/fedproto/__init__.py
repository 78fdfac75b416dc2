"""FedProto's card: its own settings, its recipe and its entry in the registry, without torch
(the method itself: ``maths.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedapp.config import UploadLayout, opt
from fedapp.runtime.recipes import SGD_HALF
from strategies import Method


@dataclass(frozen=True)
class FedProtoSettings:
    """``fedproto.*``."""

    lam: float = opt(1.0, "weight lambda of the prototype distance", low=0.0, key="lambda")
    eval_rule: str = opt("head", "headline prediction: the model's own 'head' or the "
                         "'nearest-prototype' (both are reported)",
                         choices=("head", "nearest-prototype"))
    prototypes: str = opt(
        "after-training", "a client's prototype of class c: the exact mean of its trained "
        "model's representations ('after-training', the paper's equation) or the mean of those "
        "its training steps computed while the model changed ('during-training': FedProto's "
        "released code, HtFLlib)", choices=("after-training", "during-training"))
    average: str = opt("counts", "the global prototype of c: the clients' prototypes weighted "
                       "by their counts |D_kc| ('counts', the paper) or each client once "
                       "('uniform': FedProto's released code, HtFLlib)",
                       choices=("counts", "uniform"))


METHOD = Method("per-class prototypes up, count-weighted global prototypes down; "
                "CE + lambda * distance",
                strategy_class="FedProto", client_class="FedProtoClient", shared_dim=True,
                settings=FedProtoSettings,
                # The authors' batch is 4; HtFLlib's 10 is the practical one.
                recipe={**SGD_HALF, "weight-decay": 0.0, "batch-size": 10,
                        "drop-last": True},
                payload_kinds=("class-rows",),
                secure_aggregation="fixed-layout",
                upload_layout=UploadLayout(class_in_name=r"class-(\d+)/"))
